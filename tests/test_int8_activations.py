"""The integer-activation decode kernels (`kernels/gguf_int8.h`, `--decode-activations int8`,
and int16, the default, for steps of one or two rows).

Their contract: each 32 activations of a row become integer codes and one fp32 scale (L = 127
for int8, 16,256 for int16; dx = amax / L, code = round-half-even(x * (L / amax))), written
x^ = code * dx; then every weight
takes its exact dequantized value and the products are summed in fp32. So the kernel is held
to `x^ @ dequantize().T` computed in float64, within the fp32 bound the fp32 kernel has
(test_weight_types), taken over |a q| + 2 |m| for a weight a q + m: the kernel multiplies the
codes' sum by the scale and adds the minimum's term apart. Its cost against fp32 activations,
|x - x^| <= dx / 2 an input (amax / 254, amax / 32,512), is checked as a bound too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import loopback
from child_process import terminate, wait_answering
from ports import free_port
from prefixcache.engine import kernels
from prefixcache.engine.engine import EngineConfig, LLMEngine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.weight_types import WEIGHT_TYPES_BY_NAME, PackedWeight, WeightType
from prefixcache.engine.weight_types.packed_weight import row_limits
from prefixcache.engine.weight_types.random_blocks import random_blocks
from prefixcache.engine.weights import load_model
from process_fixtures import serve_usage_error

TYPES = WEIGHT_TYPES_BY_NAME
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The affine types' code bytes (a weight is a q + m): zeroed, a block dequantizes to its m.
CODE_BYTES = {"Q4_1": (4, 20), "Q5_1": (4, 24), "Q4_K": (16, 144), "Q5_K": (16, 176)}
ROWS = (*range(1, 9), 20, 48)  # 20: passes of 8, 8 and 4 rows; 48: AVX-512's old limit
LIMITS = {8: 127, 16: 16256}  # the largest code of each width
BIT_ROWS = {8: ROWS, 16: (1, 2)}  # int16 codes meet the weights in steps of one or two rows
UNIT = 2.0**-24
CACHE_TOL = 0.25  # nats: caching on against off, int8 activations (measured 0.04-0.1)


def quantized(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """x^ in float64, computed in float32 as the contract says (numpy rounds half to even)."""
    limit = np.float32(LIMITS[bits])
    groups = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, limit / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(groups * inverse)
    scale = (amax / limit).astype(np.float32)
    return torch.from_numpy((codes.astype(np.float64) * scale).reshape(x.shape))


def minimums(raw: np.ndarray, wtype: WeightType, shape: tuple[int, int]) -> torch.Tensor:
    """Each weight's m (0 for the types without one): its block with the codes zeroed."""
    if wtype.name not in CODE_BYTES:
        return torch.zeros(shape, dtype=torch.float64)
    start, stop = CODE_BYTES[wtype.name]
    blocks = raw.reshape(shape[0], -1, wtype.block_bytes).copy()
    blocks[..., start:stop] = 0
    zeroed = PackedWeight.from_gguf(blocks.reshape(shape[0], -1), wtype.code, shape)
    return zeroed.dequantize().double()


def test_the_int8_kernels_exist_wherever_avx2_does(native: None) -> None:
    """A CPU with AVX2 and FMA (AVX-512 ones too) gets the kernel for the eight types; the
    others (F16, BF16, Q2_K, Q3_K) keep fp32 activations, with or without it."""
    flags = set(kernels._cpu_features().split())
    avx2 = {"avx2", "fma"} <= flags
    for name, wtype in TYPES.items():
        expected = avx2 and name in INT8_TYPES
        assert torch.ops.prefixcache.gguf_int8(wtype.code) == expected, name


@pytest.mark.parametrize("bits", LIMITS)
@pytest.mark.parametrize("name", INT8_TYPES)
def test_integer_matmul_is_the_product_with_the_rounded_activations(
    native: None, name: str, bits: int
) -> None:
    wtype = TYPES[name]
    shape = (67, 512)  # 67 rows: no split of the two threads' rows divides it
    raw = random_blocks(wtype, *shape, seed=3)
    weight = PackedWeight.from_gguf(raw, wtype.code, shape)
    dense = weight.dequantize().double()
    m = minimums(raw, wtype, shape)
    generator = torch.Generator().manual_seed(4)
    for rows in BIT_ROWS[bits]:
        x = torch.randn(rows, shape[1], generator=generator) * 3
        x[0, :32] = 0  # a group of zeros: scale 0, codes 0
        x[-1, 32:64] *= 1e-4  # a small group: its own scale
        x_hat = quantized(x, bits)
        got = int8_matmul(weight, x, bits).double()
        bound = shape[1] * UNIT * (x_hat.abs() @ ((dense - m).abs() + 2 * m.abs()).T)
        excess = (got - x_hat @ dense.T).abs() - bound
        assert excess.max() <= 0, f"{name}, {rows} rows: exceeds the bound by {excess.max():.3g}"
        rounding = (x - x_hat).abs().reshape(rows, -1, 32).amax(-1, keepdim=True)
        half_step = x.abs().reshape(rows, -1, 32).amax(-1, keepdim=True) / (2 * LIMITS[bits])
        # x * (L / amax) is rounded in fp32 first: at int16's L a code may sit ~1e-3 of a step off
        assert (rounding <= half_step * 1.01).all()
        cost = (half_step.double().squeeze(-1)).repeat_interleave(32, -1)
        assert ((got - x.double() @ dense.T).abs() <= cost @ dense.abs().T + 2 * bound).all()


def int8_matmul(weight: PackedWeight, x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """`weight.matmul(x, activation_bits=bits)` with the decode kernel taking all of x's rows
    whatever this CPU's limit (`row_limits()`), so every row count meets the integer kernel."""
    op, rows = torch.ops.prefixcache.gguf_matmul, x.shape[0]
    return op(x, weight.blocks, weight.wtype.code, weight.shape[1], rows, rows, bits)


def test_rows_past_the_decode_limit_and_other_types_keep_fp32(native: None) -> None:
    """Rows past the decode kernel's limit (the panel kernel's or sgemm's), a type without
    an integer kernel, and int16 past two rows give the fp32 numbers."""
    limits = row_limits()
    cases = (("Q4_K", limits.decode + 1), ("Q4_K", limits.panel + 1), ("Q3_K", 3), ("F16", 2))
    for name, rows in cases:
        wtype = TYPES[name]
        weight = PackedWeight.from_gguf(random_blocks(wtype, 40, 256), wtype.code, (40, 256))
        x = torch.randn(rows, 256)
        assert torch.equal(weight.matmul(x, activation_bits=8), weight.matmul(x)), name
    weight = PackedWeight.from_gguf(
        random_blocks(TYPES["Q4_1"], 40, 256), TYPES["Q4_1"].code, (40, 256)
    )
    for rows, fp32 in ((2, False), (3, True), (limits.decode, True)):
        x = torch.randn(rows, 256)
        same = torch.equal(int8_matmul(weight, x, 16), weight.matmul(x, activation_bits=32))
        assert same == fp32, rows


def test_an_unknown_decode_activation_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="decode_activations 'int4' is not one of fp32, int16, int8"
    ):
        LLMEngine(load_model(), EngineConfig(num_kv_blocks=16, decode_activations="int4"))
    last = serve_usage_error("--decode-activations", "int4")
    assert "--decode-activations" in last and "'int4'" in last and "fp32" in last


def test_a_replica_serves_int8_activations_and_says_so(tmp_path: Path) -> None:
    """`serve --decode-activations int8` answers, and /health names the activations and a
    namespace digest a default (int16) engine of the same file does not have (a router never
    mixes their KV)."""
    default = LLMEngine(load_model(), EngineConfig(num_kv_blocks=16)).manager.root_digest.hex()
    port, log = free_port(), tmp_path / "serve.log"
    command = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port)]
    command += ["--decode-activations", "int8", "--kv-cache-blocks", "64"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(process, f"{url}/health", "serve", log.read_text, timeout=120)
        health = loopback.get(f"{url}/health", timeout=30).json()
        body = {"model": health["model"], "prompt": "The cache", "max_tokens": 4}
        reply = loopback.post(f"{url}/v1/completions", json=body, timeout=120)
    finally:
        terminate(process)
    assert reply.status_code == 200, reply.text
    assert health["decode_activations"] == "int8"
    assert health["namespace_digest"] != default


def _first_token_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Each prompt's first generated token's top-5 logprobs, the prompts one after another."""
    found = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                final = output if output.finished else final
        found.append(dict(final.outputs[0].logprobs[0].top))
    return found


def test_int8_caching_on_and_off_agree_within_the_rounding_not_token_for_token() -> None:
    """With int8 activations a cached prefix and its suffix (a 17-row fused chunk) are not
    computed as one 113-row eager pass: the two paths' fp32 differences (~1e-6) flip some
    int8 roundings, and each layer rounds afresh, so the two agree within the rounding's own
    noise, not bit for bit (as llama.cpp's reused prompts). The tier never mixes the two:
    the KV namespace names the activations."""
    loaded = load_model()
    document = loaded.tokenizer.encode("The rules of the cache, in order: " * 12)
    prompts = [document + loaded.tokenizer.encode(f" Rule {i} says") for i in range(3)]
    results = {}
    for caching in (True, False):
        config = EngineConfig(
            num_kv_blocks=64, decode_activations="int8", enable_prefix_caching=caching
        )
        engine = LLMEngine(loaded, config)
        results[caching] = _first_token_logprobs(engine, prompts)
        assert engine.manager.stats.hits == (2 * 96 if caching else 0)
    for cached, uncached in zip(results[True], results[False], strict=True):
        for token in cached.keys() & uncached.keys():
            assert abs(cached[token] - uncached[token]) < CACHE_TOL
        assert len(cached.keys() & uncached.keys()) >= 4  # the same candidates
    default = LLMEngine(loaded, EngineConfig(num_kv_blocks=16))
    fp32 = LLMEngine(loaded, EngineConfig(num_kv_blocks=16, decode_activations="fp32"))
    assert dict(engine.manager.namespace.extra).get("decode_activations") == "int8"
    assert dict(fp32.manager.namespace.extra).get("decode_activations") == "fp32"
    assert "decode_activations" not in dict(default.manager.namespace.extra)
