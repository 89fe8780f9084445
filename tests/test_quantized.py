"""Int4 layers on Q4 blocks: the kernel's arithmetic, and logits vs the dequantized reference.

The int4 path computes `bf16(bf16(x) @ W'^T)` (engine/quant.py), so it is not bit-exact
against fp32: the tolerances below are what bfloat16 activations cost, measured on these
models with margin. The dense kernel it uses for many rows computes the same numbers.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine_fixtures import (
    assert_pool_clean,
    default_engine,
    default_model,
    default_reference,
    run_to_completion,
)
from prefixcache.engine import kernels, quant
from prefixcache.engine.engine import EngineConfig
from prefixcache.engine.int4_head import Int4Head
from prefixcache.engine.models.llama import LlamaModel
from prefixcache.engine.quant import Int4Linear, Q4Blocks
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.weight_types.linear import PackedLinear
from test_model_logits import Pair, Runner, _hf_config, _model_config, _tokens, hf_logits

# Random 3-layer models (logits std ~2): error bounds as fractions of the reference logits'
# standard deviation (measured: max 0.17, mean 0.014).
RANDOM_MAX = 0.3
RANDOM_MEAN = 0.03
# SmolLM2-135M Q4_1 vs transformers on the same GGUF dequantized, last position, logits
# centred (a shift changes no probability), std ~3.3. Measured over PROMPTS: max 0.27, mean
# 0.05, log-probability of the reference's top 10 within 0.10 nats; top-1 always agrees.
# (The dequantized path matches within 1e-3: tests/test_default_model.py.)
REAL_MAX = 0.6
REAL_MEAN = 0.1
REAL_TOP_LOGPROB = 0.25
PROMPTS = [
    "The capital of France is",
    "Paged attention reads keys through block tables.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Question: what is 17 + 25? Answer:",
    "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n",
]


def random_blocks(out: int, num_in: int, generator: torch.Generator) -> Q4Blocks:
    """Q4_1-like blocks: fp16 scales and minimums, codes 0..15."""
    groups = num_in // quant.GROUP_SIZE
    codes = torch.randint(0, 16, (out, num_in), generator=generator, dtype=torch.uint8)
    scales = (0.02 + 0.04 * torch.rand(out, groups, generator=generator)).half().float()
    mins = (-7.5 * scales * (1 + 0.2 * torch.randn(out, groups, generator=generator))).half()
    return Q4Blocks(codes, scales, mins.float())


def quantized_pair(tied: bool) -> tuple[Pair, dict[str, Q4Blocks]]:
    """A random HF model whose linear layers are dequantized Q4 blocks, and ours on int4."""
    generator = torch.Generator().manual_seed(7)
    hf = transformers.LlamaForCausalLM(_hf_config(tied=tied)).eval()
    blocks = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".layers." in name and p.dim() == 2:
                blocks[name] = random_blocks(*p.shape, generator)
                p.copy_(blocks[name].dequantize())
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=generator))
    config = _model_config(hf.config)
    ours = LlamaModel(config)
    ours.load_weights(hf.state_dict())
    assert len(ours.quantize(blocks)) == len(blocks) == 7 * config.num_layers
    return Pair(hf, ours, config), blocks


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qpair(request: pytest.FixtureRequest) -> Pair:
    return quantized_pair(tied=request.param)[0]


def _near(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the random models' tolerance; `ref` spans enough positions for its std."""
    err, std = (ours - ref).abs(), ref.std().item()
    assert err.max().item() < RANDOM_MAX * std, f"max abs error {err.max().item()}, std {std}"
    assert err.mean().item() < RANDOM_MEAN * std, f"mean abs error {err.mean().item()}"


# --- the kernel's arithmetic -----------------------------------------------------------------


def test_the_dense_weights_are_the_kernels_own_dequantization() -> None:
    linear = Int4Linear(random_blocks(48, 64, torch.Generator().manual_seed(1)))
    identity = torch.eye(64, dtype=quant.KERNEL_DTYPE)
    columns = quant.int4_matmul(linear, identity).float()  # bf16 of each W' column
    assert torch.equal(columns, linear.weight.t().to(quant.KERNEL_DTYPE).float())


def test_int4_and_dense_kernels_give_the_same_numbers() -> None:
    """Same products, other summation order: equal but for rare one-ulp bf16 roundings."""
    blocks = quant.as_q4_blocks(default_model().quantized["model.layers.2.mlp.down_proj.weight"])
    assert blocks is not None
    linear = Int4Linear(blocks)
    x = torch.randn(16, blocks.shape[1], generator=torch.Generator().manual_seed(2))
    a = quant.int4_matmul(linear, x.to(quant.KERNEL_DTYPE)).float()
    b = quant.dense_matmul(linear, x.to(quant.KERNEL_DTYPE)).float()
    assert (a == b).float().mean() > 0.999
    ulp = torch.ldexp(torch.ones_like(a), torch.frexp(a.abs().maximum(b.abs())).exponent - 8)
    assert ((a - b).abs() <= ulp).all()


def test_the_native_rounding_gives_the_dense_paths_numbers_bit_for_bit() -> None:
    """kernels/round_bf16.cpp: the prefill path's one-pass bf16 roundings equal the casts."""
    assert kernels.available()
    linear = Int4Linear(random_blocks(256, 96, torch.Generator().manual_seed(3)))
    x = torch.randn(60, 96, generator=torch.Generator().manual_seed(4)) * 50
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), 3.3e38, 1 + 2**-9])
    expected = quant.dense_matmul(linear, x.to(quant.KERNEL_DTYPE)).float()
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}  # inf - inf rows are NaN on both
    torch.testing.assert_close(quant.rounded_dense_matmul(linear, x.clone()), expected, **exact)
    torch.testing.assert_close(linear(x.clone()), expected, **exact)  # > 48 rows: dense
    specials = torch.tensor([float("nan"), 2**-130, -(2**-149), 65504.0, 1 + 2**-8])
    rounded = torch.ops.prefixcache.round_bf16_(specials.clone())
    reference = specials.to(torch.bfloat16).float()
    assert torch.isnan(rounded[0]) and torch.equal(rounded[1:], reference[1:])


def test_q4_blocks_dequantize_exactly_as_gguf_does() -> None:
    loaded = default_model()
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"):  # q, k: permuted rows
        hf = f"model.layers.5.{name}.weight"
        blocks = quant.as_q4_blocks(loaded.quantized[hf])
        assert blocks is not None and torch.equal(blocks.dequantize(), loaded.state_dict[hf])
        assert torch.equal(loaded.quantized[hf].dequantize(), loaded.state_dict[hf])
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(4, 2, 18), dtype=np.uint8)  # Q4_0: fp16 d, 16 bytes
    raw[..., :2] = np.float16(0.01 * rng.random((4, 2))).view(np.uint8).reshape(4, 2, 2)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    expected = gguf.quants.dequantize(raw.reshape(4, 36), q4_0)
    blocks = quant.q4_blocks(raw.reshape(4, 36), q4_0, (4, 64))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


def _q8_head() -> quant.Q8Blocks:
    """The default model's Q8_0 output matrix (its tied embedding) as `Q8Blocks`."""
    blocks = quant.as_q8_blocks(default_model().quantized["model.embed_tokens.weight"])
    assert isinstance(blocks, quant.Q8Blocks)
    return blocks


def test_q8_planes_sum_to_the_matrix() -> None:
    blocks = _q8_head()
    planes = blocks.planes().dequantize()
    exact = default_model().state_dict["model.embed_tokens.weight"]
    assert torch.equal(planes[: exact.shape[0]] + planes[exact.shape[0] :], exact)


def test_the_head_is_exact_where_the_argmax_can_be() -> None:
    """Approximate logits within their bound; exact fp32 for every possible argmax."""
    loaded = default_model()
    weight = loaded.state_dict["model.embed_tokens.weight"]
    head = Int4Head(_q8_head(), weight)
    hidden = torch.randn(12, weight.shape[1], generator=torch.Generator().manual_seed(5))
    hidden[6:] *= 4  # sharper rows, larger errors
    exact = torch.nn.functional.linear(hidden, weight)
    h16 = hidden.to(quant.KERNEL_DTYPE)
    parts = quant.int4_matmul(head.planes, h16).float().view(12, 2, -1)
    approx = parts.sum(1)
    bound = head._bound(hidden, h16, parts, approx)
    assert ((approx - exact).abs() <= bound).all()
    logits = head(hidden)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = logits.argmax(-1, keepdim=True)
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert ((logits - exact).abs() <= bound).all()


def test_the_native_head_pass_gives_the_torch_paths_logits(monkeypatch) -> None:
    """kernels/head_logits.cpp: the same approximations, the same tokens refined, the
    refined ones equal to fp32 rounding (summed in double there)."""
    loaded = default_model()
    weight = loaded.state_dict["model.embed_tokens.weight"]
    head = Int4Head(_q8_head(), weight)
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(7)) * 3
    assert kernels.available()
    native = head(hidden)
    monkeypatch.setattr(kernels, "available", lambda: False)
    reference = head(hidden)
    approx = quant.int4_matmul(head.planes, hidden.bfloat16()).float().view(5, 2, -1).sum(1)
    refined_native, refined_torch = native != approx, reference != approx
    assert torch.equal(refined_native, refined_torch) and refined_native.any()
    assert torch.equal(native[~refined_native], reference[~refined_torch])
    assert torch.allclose(native[refined_native], reference[refined_torch], rtol=1e-6, atol=1e-6)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))


def test_the_default_model_runs_every_layer_weight_on_its_gguf_blocks() -> None:
    """On the GGUF blocks' vectorized kernels where this CPU has them, else torch's int4."""
    engine = default_engine()
    assert EngineConfig().quantized_weights  # the default: the engine above has it
    assert len(engine.int4_weights) == 7 * engine.model_config.num_layers + 1  # and the head
    simd = kernels.simd_decoders()
    kind = PackedLinear if simd else Int4Linear
    assert all(isinstance(layer.gate_up, kind) for layer in engine.model.layers)
    assert isinstance(engine.model.head, PackedLinear if simd else Int4Head)
    assert ("weights", "gguf" if simd else "int4") in engine._namespace_extra()
    dense = default_engine(quantized=False)
    assert not dense.int4_weights
    assert dense.manager.root_digest != engine.manager.root_digest  # other KV values


# --- logits against the dequantized reference ------------------------------------------------


def test_prefill_matches_the_dequantized_reference(qpair: Pair) -> None:
    runner = Runner(qpair, seed=1)
    seq = runner.new_seq(_tokens(37, 1))  # 37 rows: the dense kernel
    (logits,) = runner.step([(seq, 37)])
    _near(logits, hf_logits(qpair, seq.tokens))


def test_chunks_and_decodes_match_the_dequantized_reference(qpair: Pair) -> None:
    runner = Runner(qpair, seed=2)
    seqs = [runner.new_seq(_tokens(n + 6, 20 + n)) for n in (3, 9, 14)]
    refs = [hf_logits(qpair, s.tokens) for s in seqs]
    runner.step([(s, len(s.tokens) - 6) for s in seqs])  # prefill: 26 rows
    decoded: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(6):  # three decode rows a step: the int4 kernel
        for out, logits in zip(decoded, runner.step([(s, 1) for s in seqs]), strict=True):
            out.append(logits)
    for s, ref, out in zip(seqs, refs, decoded, strict=True):
        _near(torch.cat(out), ref[len(s.tokens) - 6 :])


def test_real_gguf_logits_near_transformers() -> None:
    loaded = default_model()
    reference = default_reference()
    engine = default_engine()
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        engine.add_request("q", ids, SamplingParams(temperature=0, max_tokens=1))
        logits = engine._forward(engine.scheduler.schedule())[0]
        engine.abort_request("q")
        error = ((logits - logits.mean()) - (expected - expected.mean())).abs()
        assert error.max() < REAL_MAX and error.mean() < REAL_MEAN, prompt
        top = expected.topk(10).indices
        logprobs = torch.log_softmax(logits, -1) - torch.log_softmax(expected, -1)
        assert logprobs[top].abs().max() < REAL_TOP_LOGPROB, prompt
        assert logits.argmax() == expected.argmax(), prompt
    assert_pool_clean(engine)


# --- caching on and off ---------------------------------------------------------------------


def test_caching_on_and_off_give_the_same_tokens_on_the_real_model() -> None:
    """A shared document and several questions: cached prefixes, int4 decode rows."""
    loaded = default_model()
    rng = np.random.default_rng(4)
    document = loaded.tokenizer.encode("Tables of blocks, " * 60, add_special_tokens=True)
    prompts = [document + [int(t) for t in rng.integers(1000, 40000, 12)] for _ in range(6)]
    tokens = {}
    for caching in (True, False):
        engine = default_engine(caching=caching)
        hits_before = engine.manager.stats.hits
        finals = {}
        for i, prompt in enumerate(prompts):  # the first two together, then one at a time
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
            if i:
                finals.update(run_to_completion(engine))
        tokens[caching] = {k: v.token_ids for k, v in finals.items()}
        assert (engine.manager.stats.hits > hits_before) == caching
        assert_pool_clean(engine)
    assert tokens[True] == tokens[False]
