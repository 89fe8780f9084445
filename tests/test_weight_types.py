"""GGUF weight types (engine/weight_types): dequantization bit for bit as gguf-py's, every
kernel against dequantize-then-matmul in float64, row operations, bad input.

Kernel tolerance: each weight takes exactly its dequantized fp32 value and the activations stay
fp32, so the only error is the fp32 dot product's: |y - x.w| <= n u sum_i |x_i w_i| with
u = 2^-24 and n = in (the classic bound gamma_n ~ n u, whatever the summation order).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gguf
import numpy as np
import pytest
import torch

from gemma_fixtures import gemma_file
from hf_fixtures import gguf_reader
from prefixcache.engine import kernels
from prefixcache.engine.weight_types import WEIGHT_TYPES_BY_NAME, PackedWeight, WeightType
from prefixcache.engine.weight_types import packed_weight as packed_weight_module
from prefixcache.engine.weight_types.packed_weight import ROW_LIMITS
from prefixcache.engine.weight_types.random_blocks import random_blocks

TYPES = WEIGHT_TYPES_BY_NAME
DECODE_ROWS = (*range(1, 9), 20)  # 20: passes of 8, 8 and 4 rows
# Both sides of every row limit of every vector unit (packed_weight.ROW_LIMITS: decode kernel,
# panel kernel, sgemm), and 200
LIMIT_ROWS = tuple(sorted({r + e for rows in ROW_LIMITS.values() for r in rows for e in (0, 1)}))
PREFILL_ROWS = (*LIMIT_ROWS, 200)
# The panel kernel's partial and whole register groups of 16 (AVX-512) or 8 (AVX2) rows, and
# the last few rows it takes by dot products instead (under 8 past a group of 16; under 4
# past one of 8)
PANEL_ROWS = (3, 9, 11, 12, 15, 16, 17, 23, 24, 31, 33, 47, 48, 49, 50, 65, 100)
UNIT = 2.0**-24


def reference(raw: np.ndarray, wtype: WeightType, shape: tuple[int, int]) -> np.ndarray:
    """gguf-py's dequantization of the same bytes."""
    qtype = gguf.GGMLQuantizationType(wtype.code)
    return gguf.quants.dequantize(raw, qtype).reshape(shape).astype(np.float32, copy=False)


def assert_same_bits(mine: torch.Tensor | np.ndarray, expected: np.ndarray) -> None:
    got = np.asarray(mine, dtype=np.float32)
    assert got.shape == expected.shape
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert not differ.any(), f"{int(differ.sum())} values differ, first at {np.argwhere(differ)[0]}"


def assert_matmul_within_bound(weight: PackedWeight, x: torch.Tensor) -> None:
    """`weight.matmul(x)` within the module docstring's bound of the exact float64 product."""
    assert_within_bound(weight, x, weight.matmul(x))


def assert_within_bound(weight: PackedWeight, x: torch.Tensor, got: torch.Tensor) -> None:
    """`got`, a product of `x` and `weight`, within that bound."""
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T
    bound = weight.shape[1] * UNIT * (x.double().abs() @ dense.abs().T)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], weight.shape[0])
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{x.shape[0]} rows: error exceeds the bound by {excess.max():.3g}"


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without a compiler: gguf-py's dequantization and F.linear."""
    monkeypatch.setattr(packed_weight_module.kernels, "available", lambda: False)


def test_the_decoders_built_are_the_widest_the_cpu_has(native: None) -> None:
    """-march=native on a CPU with AVX-512 (F, BW, VL) or AVX2 and FMA builds those decoders:
    the tests below then check them; a build that lost them would quietly decode 4x slower."""
    flags = set(kernels._cpu_features().split())
    expected = "portable"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma"} <= flags:
        expected = "avx2"
    assert torch.ops.prefixcache.gguf_simd() == expected


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_exact(native: None, name: str) -> None:
    wtype = TYPES[name]
    shape = (37, 512)  # 37 rows: no blocking of the kernels divides it; 2 K-quant blocks a row
    raw = random_blocks(wtype, *shape)
    weight = PackedWeight.from_gguf(raw, wtype.code, shape, "blk.0.test")
    expected = reference(raw, wtype, shape)
    assert_same_bits(weight.dequantize(), expected)
    portable = torch.ops.prefixcache.gguf_dequantize(weight.blocks, wtype.code, shape[1], True)
    assert_same_bits(portable, expected)  # the decoders of CPUs without AVX2
    assert weight.nbytes == raw.size


@pytest.mark.parametrize("name", TYPES)
def test_matmul_matches_dequantized(native: None, name: str) -> None:
    wtype = TYPES[name]
    shape = (301, 512)  # more than one prefill tile of 512 inputs (256 rows); an odd count, so
    # a thread's last output row goes through the two-row AVX-512 kernel's one-row tail
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=1), wtype.code, shape)
    generator = torch.Generator().manual_seed(2)
    for rows in (*DECODE_ROWS, *PREFILL_ROWS):
        assert_matmul_within_bound(weight, torch.randn(rows, shape[1], generator=generator))


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` inside, restored after (the suite runs one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def panel_matmul(weight: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """`weight.matmul(x)` through the panel kernel whatever the row count (sgemm in a build
    without one: the portable decoders)."""
    op = torch.ops.prefixcache.gguf_matmul
    return op(x, weight.blocks, weight.wtype.code, weight.shape[1], 0, x.shape[0])


@pytest.mark.parametrize("name", TYPES)
def test_the_panel_kernel_matches_dequantized(native: None, name: str) -> None:
    """The panel kernel (`kernels/gguf_panel.h`) on any row count, whatever this CPU's limits:
    301 output rows end in a partial panel; one and two threads split the panels."""
    wtype = TYPES[name]
    shape = (301, 512)
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=13), wtype.code, shape)
    generator = torch.Generator().manual_seed(14)
    for count in (1, 2):
        with torch_threads(count):
            for rows in PANEL_ROWS:
                x = torch.randn(rows, shape[1], generator=generator)
                assert_within_bound(weight, x, panel_matmul(weight, x))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_the_panel_kernel_on_rows_of_any_width(native: None, name: str) -> None:
    """F16/BF16 rows need not be a multiple of a register's inputs: 40 inputs, and 17 and 33
    activation rows, whose last one would otherwise go by dot products of 16 inputs."""
    wtype = TYPES[name]
    shape = (37, 40)
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=15), wtype.code, shape)
    generator = torch.Generator().manual_seed(16)
    for rows in (17, 33):
        x = torch.randn(rows, shape[1], generator=generator)
        assert_within_bound(weight, x, panel_matmul(weight, x))


def test_prefill_on_a_matrix_too_large_to_decode_whole_goes_by_tiles(native: None) -> None:
    """Past 64 MB of fp32 (an output matrix over a large vocabulary) the prefill kernel
    decodes tile by tile instead of whole: the same bound holds."""
    wtype = TYPES["Q4_0"]
    shape = (32800, 512)  # 67 MB in fp32; 32,800 rows: the last tile is a partial one
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=11), wtype.code, shape)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(12))
    assert_matmul_within_bound(weight, x)


@pytest.mark.parametrize("name", ["Q5_0", "Q4_K", "Q6_K", "Q8_0"])
def test_matmul_on_gemma_shapes(native: None, name: str) -> None:
    """The shapes of Gemma 3 270M's projections of these types, decode and prefill."""
    wtype = TYPES[name]
    shape = (1024, 640) if wtype.block_values == 32 else (640, 2048)
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=3), wtype.code, shape)
    generator = torch.Generator().manual_seed(4)
    for rows in (1, 8, 48):
        assert_matmul_within_bound(weight, torch.randn(rows, shape[1], generator=generator))


@pytest.mark.parametrize("name", ["Q5_0", "Q6_K", "BF16"])
def test_matmul_split_over_two_threads(native: None, name: str) -> None:
    """The suite runs one torch thread: here the kernels' parallel loops split the rows."""
    wtype = TYPES[name]
    shape = (300, 512)
    weight = PackedWeight.from_gguf(random_blocks(wtype, *shape, seed=9), wtype.code, shape)
    with torch_threads(2):
        generator = torch.Generator().manual_seed(10)
        for rows in (1, 8, 20, 48):
            assert_matmul_within_bound(weight, torch.randn(rows, 512, generator=generator))
        with torch.inference_mode():  # as the model runs it: each worker thread must be too
            x = torch.randn(200, 512, generator=generator)
            assert_matmul_within_bound(weight, x)


@pytest.mark.parametrize("name", ["F32", "Q4_K", "Q6_K"])
def test_without_native_kernels(no_native: None, name: str) -> None:
    wtype = TYPES[name]
    shape = (37, 512)
    raw = random_blocks(wtype, *shape, seed=5)
    weight = PackedWeight.from_gguf(raw, wtype.code, shape)
    assert_same_bits(weight.dequantize(), reference(raw, wtype, shape))
    assert_matmul_within_bound(weight, torch.randn(3, shape[1]))


@pytest.mark.parametrize("name", ["Q8_0", "Q5_K", "BF16"])
def test_row_operations(native: None, name: str) -> None:
    wtype = TYPES[name]
    shape = (40, 256)
    raw = random_blocks(wtype, *shape, seed=6)
    weight = PackedWeight.from_gguf(raw, wtype.code, shape, "token_embd.weight")
    dense = torch.from_numpy(reference(raw, wtype, shape))
    ids = torch.tensor([[3, 0, 39], [3, 17, 5]])
    assert_same_bits(weight.dequantize_rows(ids), dense[ids].numpy())
    assert weight.dequantize_rows([]).shape == (0, 256)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(7))
    taken = weight.take_rows(order)
    assert taken.shape == (40, 256)
    assert_same_bits(taken.dequantize(), dense[order].numpy())
    head = weight.take_rows(range(10))
    fused = PackedWeight.cat([head, weight, head])
    assert fused.shape == (60, 256) and fused.nbytes == weight.nbytes * 60 // 40
    assert_same_bits(fused.dequantize(), torch.cat([dense[:10], dense, dense[:10]]).numpy())
    assert_matmul_within_bound(fused, torch.randn(2, 256))
    assert weight.take_rows([]).matmul(torch.randn(3, 256)).shape == (3, 0)
    assert weight.matmul(torch.randn(0, 256)).shape == (0, 40)


def test_row_ids_out_of_range_are_refused(native: None) -> None:
    wtype = TYPES["Q8_0"]
    weight = PackedWeight.from_gguf(random_blocks(wtype, 4, 32), wtype.code, (4, 32), "emb")
    with pytest.raises(ValueError, match=r"emb: row id 4 is outside 0\.\.3"):
        weight.dequantize_rows([0, 4])
    with pytest.raises(ValueError, match=r"emb: row order entry -1 is outside 0\.\.3"):
        weight.take_rows([-1, 0])
    with pytest.raises(ValueError, match="must be integers"):
        weight.dequantize_rows(torch.tensor([0.5]))


def test_truncated_bytes_are_refused() -> None:
    wtype = TYPES["Q4_K"]
    raw = random_blocks(wtype, 4, 512)
    with pytest.raises(
        ValueError, match=r"blk\.3\.ffn_down\.weight: 1151 bytes, .*Q4_K \[4, 512\] needs 1152"
    ):
        PackedWeight.from_gguf(raw.reshape(-1)[:-1], wtype.code, (4, 512), "blk.3.ffn_down.weight")


def test_unknown_types_are_refused() -> None:
    raw = np.zeros(64, np.uint8)
    with pytest.raises(
        ValueError, match=r"blk\.0\.attn_q\.weight: GGML type 16 \(IQ2_XXS\) is not supported"
    ):
        PackedWeight.from_gguf(raw, 16, (1, 256), "blk.0.attn_q.weight")
    with pytest.raises(
        ValueError, match=r"w: GGML type 99 \(unknown\) is not supported \(supported: F32, "
    ):
        PackedWeight.from_gguf(raw, 99, (1, 256), "w")


def test_shapes_that_are_not_whole_blocks_are_refused() -> None:
    wtype = TYPES["Q6_K"]
    with pytest.raises(
        ValueError,
        match=r"output\.weight: in_features 640 is not a multiple of Q6_K's block of 256",
    ):
        PackedWeight.from_gguf(np.zeros(2100, np.uint8), wtype.code, (4, 640), "output.weight")
    with pytest.raises(ValueError, match=r"not a matrix \[out, in\]"):
        PackedWeight.from_gguf(np.zeros(210, np.uint8), wtype.code, (256,), "norm")


def test_bad_matmul_inputs_and_parts_are_refused(native: None) -> None:
    q8, q4 = TYPES["Q8_0"], TYPES["Q4_0"]
    a = PackedWeight.from_gguf(random_blocks(q8, 4, 64), q8.code, (4, 64), "a")
    b = PackedWeight.from_gguf(random_blocks(q4, 4, 64), q4.code, (4, 64), "b")
    with pytest.raises(ValueError, match=r"a: matmul takes fp32 \[tokens, 64\], got torch.float64"):
        a.matmul(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"got torch.float32 \[1, 32\]"):
        a.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match=r"cannot concatenate b \(Q4_0 \[4, 64\]\) after a \(Q8_0"):
        PackedWeight.cat([a, b])


def test_gemma_q4_k_m_tensors_dequantize_bit_exactly(native: None) -> None:
    """Every quantized tensor of a real Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0) against gguf-py;
    the [262144 x 640] embedding on a random 16th of its rows (gguf-py takes ~7 s for all).
    The first tensor of each type also goes through the kernels."""
    reader = gguf_reader(gemma_file())  # parsed once per worker (hf_fixtures.py, GROUPS)
    seen: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        out, num_in = int(np.prod(tensor.shape[1:])), int(tensor.shape[0])
        weight = PackedWeight.from_gguf(tensor.data, tensor.tensor_type, (out, num_in), tensor.name)
        rows = np.arange(out)
        if out > 100_000:
            rows = np.sort(np.random.default_rng(8).choice(out, out // 16, replace=False))
        expected = gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type)
        assert_same_bits(weight.dequantize_rows(torch.from_numpy(rows)), expected)
        if tensor.tensor_type.name not in seen and out < 100_000:  # the kernels on real blocks
            for count in (1, 8, 48):
                assert_matmul_within_bound(weight, torch.randn(count, num_in))
        seen[tensor.tensor_type.name] = seen.get(tensor.tensor_type.name, 0) + 1
    assert seen == {"Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
