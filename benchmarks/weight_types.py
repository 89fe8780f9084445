"""GGUF weight types' kernels (engine/weight_types) on Gemma-3-270M-like shapes.

Per type and shape: decode (1 row) and prefill (256 rows) through `PackedWeight.matmul`
(again with int16 and int8 activations where the type has those kernels), beside torch's int4 kernel
path (`quant.Int4Linear` on a Q4_0 matrix of the same shape: its
int4 kernel for 1 row, its dense bf16-rounded path for 256) and a dense fp32 `F.linear`.
"hot" repeats one matrix (it stays in the 32 MB L3 here); "cold" cycles through copies
totalling `COLD_BYTES`, as a model's decode step reads each weight once from memory. GB/s
counts the bytes each kernel reads (the GGUF bytes; int4: packed codes and bf16 scale pairs;
dense: fp32). `--crossover` times the decode, panel and sgemm kernels per row count through
stacks of model-shaped layers instead (what `packed_weight.ROW_LIMITS` is set from). Run alone
on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from prefixcache.engine import kernels, quant
from prefixcache.engine.weight_types import WEIGHT_TYPES_BY_NAME, PackedWeight, WeightType
from prefixcache.engine.weight_types.random_blocks import random_blocks

SHAPES = ((2048, 640), (640, 2048), (1024, 640), (640, 1024))  # [out, in]
DEFAULT_TYPES = ("Q5_0", "Q4_K", "Q6_K", "Q8_0")
PREFILL_ROWS = 256
COLD_BYTES = 96 << 20
TYPES = WEIGHT_TYPES_BY_NAME


def seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of `call` after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cold_seconds(calls: list[Callable[[], object]], rounds: int = 5) -> float:
    """Median time per call while cycling through `calls` (each on its own copy)."""
    return seconds(lambda: [c() for c in calls], rounds) / len(calls)


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def row(label: str, nbytes: int, hot: float, cold: float, prefill: float, flops: float) -> str:
    return (
        f"  {label:<12} {nbytes / 1e6:6.2f} MB | decode hot {hot * 1e3:7.3f} ms "
        f"{nbytes / hot / 1e9:5.1f} GB/s, cold {cold * 1e3:7.3f} ms {nbytes / cold / 1e9:5.1f} GB/s"
        f" | prefill {prefill * 1e3:7.2f} ms {flops / prefill / 1e9:6.1f} GFLOP/s"
    )


def packed(wtype: WeightType, shape: tuple[int, int], seed: int = 0) -> PackedWeight:
    return PackedWeight.from_gguf(random_blocks(wtype, *shape, seed), wtype.code, shape)


def bench_type(wtype: WeightType, shape: tuple[int, int], bits: int = 32) -> str:
    """One type's kernels; with `bits` 16 or 8, the decode kernel on integer activations
    (`--decode-activations int16|int8`; prefill rows keep fp32 either way)."""
    x1, xp = torch.randn(1, shape[1]), torch.randn(PREFILL_ROWS, shape[1])
    weights = [packed(wtype, shape, seed) for seed in range(copies(packed(wtype, shape).nbytes))]
    hot = seconds(lambda: weights[0].matmul(x1, bits), 200)
    cold = cold_seconds([lambda w=w: w.matmul(x1, bits) for w in weights])
    prefill = seconds(lambda: weights[0].matmul(xp, bits), 10)
    flops = 2.0 * shape[0] * shape[1] * PREFILL_ROWS
    label = f"{wtype.name} int{bits}" if bits < 32 else wtype.name
    return row(label, weights[0].nbytes, hot, cold, prefill, flops)


def bench_int4(shape: tuple[int, int]) -> str:
    q4 = TYPES["Q4_0"]
    x1, xp = torch.randn(1, shape[1]), torch.randn(PREFILL_ROWS, shape[1])

    def linear(seed: int, dense: bool = False) -> quant.Int4Linear:
        raw = random_blocks(q4, *shape, seed)
        return quant.Int4Linear(quant.q4_blocks(raw, q4.code, shape), dense=dense)

    first = linear(0, dense=True)  # the copies only decode: no dense W' for them
    linears = [first, *(linear(s) for s in range(1, copies(first.nbytes_read)))]
    hot = seconds(lambda: first(x1), 200)
    cold = cold_seconds([lambda f=f: f(x1) for f in linears])
    prefill = seconds(lambda: first(xp.clone()), 10)  # its prefill path rounds x in place
    return row(
        "int4 (Q4_0)",
        first.nbytes_read,
        hot,
        cold,
        prefill,
        2.0 * shape[0] * shape[1] * PREFILL_ROWS,
    )


def bench_dense(shape: tuple[int, int]) -> str:
    x1, xp = torch.randn(1, shape[1]), torch.randn(PREFILL_ROWS, shape[1])
    nbytes = shape[0] * shape[1] * 4
    matrices = [torch.randn(shape) for _ in range(copies(nbytes))]
    hot = seconds(lambda: F.linear(x1, matrices[0]), 200)
    cold = cold_seconds([lambda m=m: F.linear(x1, m) for m in matrices])
    prefill = seconds(lambda: F.linear(xp, matrices[0]), 10)
    return row("dense fp32", nbytes, hot, cold, prefill, 2.0 * shape[0] * shape[1] * PREFILL_ROWS)


KERNEL_LIMITS = {"decode": (1 << 30, 1 << 30), "panel": (0, 1 << 30), "sgemm": (0, 0)}


def forced(weight: PackedWeight, x: torch.Tensor, kernel: str) -> torch.Tensor:
    """`weight.matmul(x)` through one kernel whatever the row count (`KERNEL_LIMITS`)."""
    op = torch.ops.prefixcache.gguf_matmul
    return op(x, weight.blocks, weight.wtype.code, weight.shape[1], *KERNEL_LIMITS[kernel])


# Models' layers as [out, in] matrices and their types: the stacks `--crossover` runs through
STACKS = {
    "SmolLM2 (30 layers, Q4_1)": (30, (((960, 576), "Q4_1"), ((576, 576), "Q4_1"),
                                       ((3072, 576), "Q4_1"), ((576, 1536), "Q4_1"))),
    "Gemma 3 (18 layers, Q5_0/Q4_K/Q6_K)": (18, (((1536, 640), "Q5_0"), ((640, 1024), "Q4_K"),
                                                 ((4096, 640), "Q5_0"), ((640, 2048), "Q6_K"))),
}  # fmt: skip
CROSSOVER_ROWS = (8, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)


def run_stack(layers: list[PackedWeight], xs: dict[int, torch.Tensor], kernel: str) -> None:
    """Each layer's product with the rows of its width, through `kernel`."""
    for w in layers:
        forced(w, xs[w.shape[1]], kernel)


def crossover() -> None:
    """Each kernel (ms) per row count through a model's stack of layers, weights cold as in a
    step: what `packed_weight.ROW_LIMITS` is set from."""
    for title, (count, spec) in STACKS.items():
        layers = [packed(TYPES[t], shape, seed) for seed in range(count) for shape, t in spec]
        print(f"{title}: decode / panel / sgemm ms a pass")
        for rows in CROSSOVER_ROWS:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in layers}
            times = [seconds(lambda: run_stack(layers, xs, k), 5) for k in KERNEL_LIMITS]  # noqa: B023
            cells = [f"{t * 1e3:.1f}" for t in times]
            print(f"  {rows:4d} rows: " + " / ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated")
    parser.add_argument("--crossover", action="store_true", help="the kernels by row count")
    args = parser.parse_args()
    types = args.types.split(",")
    assert kernels.available(), "the native kernels did not build"
    simd = torch.ops.prefixcache.gguf_simd()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {simd} decoders")
    if args.crossover:
        crossover()
        return
    for shape in SHAPES:
        print(f"[{shape[0]} x {shape[1]}] (out x in), prefill {PREFILL_ROWS} rows")
        for name in types:
            if shape[1] % TYPES[name].block_values == 0:
                print(bench_type(TYPES[name], shape))
                if torch.ops.prefixcache.gguf_int8(TYPES[name].code):
                    print(bench_type(TYPES[name], shape, bits=16))
                    print(bench_type(TYPES[name], shape, bits=8))
        print(bench_int4(shape))
        print(bench_dense(shape))


if __name__ == "__main__":
    main()
