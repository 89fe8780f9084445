"""Logits from int4 weights, exact wherever a token could be the argmax.

The output matrix is the model's largest read per decoded token (SmolLM2-135M: 113 MB in
fp32, ~45% of a decode step's weight bytes). `Int4Head` reads its 4-bit planes instead
(a Q8_0 matrix is two: `q = 16 * hi + lo`), which gives approximate logits `a` with a
rigorous per-token error bound `b` (below). Every token with `a + b >= max(a - b)` gets
its exact fp32 logit from the dense matrix; the argmax is always among them, so greedy
decoding picks exactly the fp32 argmax. The other tokens keep `a`, within `b` (typically
a few hundredths of a logit) of their exact value. Where the native kernels load, the bound
and the refinement run in one C++ pass (`kernels/head_logits.cpp`), the exact logits summed
in double; the torch code below is the reference and the fallback.

The bound, with `u = 2**-8` (bfloat16 rounding), `h` the hidden row, `h' = bf16(h)`, `W'`
the kernel's weights (`quant.kernel_weight`, bf16 scales) and `y_p` a plane's output:
    |a_n - e_n| <= |h' - h| |W'_n| + |h| |W'_n - W_n|          (inputs and scales, Cauchy-Schwarz)
                 + u / (1 - u) * sum_p |y_p,n|                 (each plane's bf16 output)
                 + K * 2**-24 * |h'| * sum_p |W'_p,n|          (fp32 accumulation)
                 + 2**-23 * |a_n|                              (summing the planes)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixcache.engine import kernels
from prefixcache.engine.quant import (
    KERNEL_DTYPE,
    Int4Linear,
    Q4Blocks,
    Q8Blocks,
    int4_matmul,
    kernel_weight,
)

# Two planes cost twice the int4 kernel's work per row: past 16 rows the dense fp32 matmul
# is faster (benchmarks/engine.py --kernels: one plane is about one gate_proj pass).
MAX_HEAD_ROWS = 16
_U = 2.0**-8
_SAFETY = 1.001  # covers the fp32 rounding of the bound's own arithmetic


class Int4Head:
    """`hidden @ W^T` for `[R, K]` hidden rows: int4 planes plus exact refinement.

    More than `MAX_HEAD_ROWS` rows use the dense fp32 matmul (exact everywhere).
    """

    __slots__ = ("weight", "planes", "num_planes", "norm", "error_norm", "plane_norms")

    def __init__(self, blocks: Q4Blocks | Q8Blocks, weight: torch.Tensor) -> None:
        planes = blocks.planes() if isinstance(blocks, Q8Blocks) else blocks
        self.weight = weight  # exact fp32 [N, K]: the dequantized matrix
        self.planes = Int4Linear(planes, dense=False)
        self.num_planes = planes.shape[0] // weight.shape[0]
        per_plane = kernel_weight(planes).view(self.num_planes, *weight.shape)
        kernel = per_plane.sum(0)  # exact: q * bf16(d) has at most 16 significant bits
        self.norm = torch.linalg.vector_norm(kernel, dim=-1)
        self.error_norm = torch.linalg.vector_norm(kernel - weight, dim=-1)
        self.plane_norms = torch.linalg.vector_norm(per_plane, dim=-1).sum(0)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[R, N]` in fp32 (see the module docstring for which are exact)."""
        if hidden.shape[0] > MAX_HEAD_ROWS or hidden.dtype != torch.float32:
            return F.linear(hidden.float(), self.weight)
        h = hidden.contiguous()
        h16 = h.to(KERNEL_DTYPE)
        planes_out = int4_matmul(self.planes, h16)
        if kernels.available():  # the same bound and refinement in one native pass
            return torch.ops.prefixcache.head_logits(
                planes_out, h, self.weight, self.norm, self.error_norm, self.plane_norms,
                self.num_planes, _SAFETY,
            )  # fmt: skip
        parts = planes_out.float().view(h.shape[0], self.num_planes, -1)
        approx = parts.sum(1)
        bound = self._bound(h, h16, parts, approx)
        rows, cols = (approx + bound >= (approx - bound).amax(-1, keepdim=True)).nonzero().T
        exact = torch.bmm(self.weight[cols][:, None, :], h[rows][:, :, None]).view(-1)
        return approx.index_put_((rows, cols), exact)

    def _bound(
        self, h: torch.Tensor, h16: torch.Tensor, parts: torch.Tensor, approx: torch.Tensor
    ) -> torch.Tensor:
        """`b` `[R, N]`: an upper bound of `|approx - exact|` per logit."""
        norm_h = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        norm_h16 = torch.linalg.vector_norm(h16.float(), dim=-1, keepdim=True)
        norm_dh = torch.linalg.vector_norm(h16.float() - h, dim=-1, keepdim=True)
        accumulate = h.shape[1] * 2.0**-24 * norm_h16
        bound = norm_dh * self.norm + norm_h * self.error_norm + accumulate * self.plane_norms
        bound += parts.abs().sum(1).mul_(_U / (1 - _U)) + approx.abs().mul_(2.0**-23)
        return bound.mul_(_SAFETY)
