"""torch.ops.prefixcache.rms_norm, the eager models' norm in one native call, against the
same formula in float64 (x / sqrt(mean(x^2) + eps) * w).

Tolerance: the sum of n squares in fp32 is within n * 2^-24 of its exact value (relative, all
terms positive), the square root halves that, and three roundings follow (divide, two
products): each output within (n / 2 + 4) * 2^-24 of the exact one, relative.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.models.llama import rms_norm

pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("native")]

EPS = 1e-6


def _exact(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    inverse = (x64.square().mean(-1, keepdim=True) + eps).rsqrt()
    return x64 * inverse * weight.double()


def _assert_within_bound(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    exact = _exact(x, weight, EPS)
    bound = (x.shape[-1] / 2 + 4) * 2**-24 * exact.abs() + 1e-30
    excess = (ours.double() - exact).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"exceeds the bound by {excess.max():.3g}"


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 9),
    n=st.sampled_from([1, 7, 64, 256, 576, 640]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_matches_the_formula(rows: int, n: int, scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=generator) * scale
    weight = torch.randn(n, generator=generator)
    ours = torch.ops.prefixcache.rms_norm(x, weight, EPS)
    assert ours.shape == x.shape and ours.dtype == torch.float32
    _assert_within_bound(ours, x, weight)


def test_a_strided_view_of_heads_is_normed_per_head_as_torch_does() -> None:
    """The QK-norms take [tokens, heads, head_dim] slices of the fused qkv output."""
    qkv = torch.randn(5, 6, 256)
    q = qkv[:, :4]  # not contiguous
    weight = torch.randn(256)
    ours = rms_norm(q, weight, EPS)
    _assert_within_bound(ours, q, weight)
    torch.testing.assert_close(ours, torch.nn.functional.rms_norm(q, (256,), weight, EPS))


def test_bad_inputs_are_refused_naming_the_problem() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        torch.ops.prefixcache.rms_norm(x, torch.randn(16), EPS)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.prefixcache.rms_norm(x.double(), torch.randn(8), EPS)
    with pytest.raises(RuntimeError, match="weight must be contiguous fp32"):
        torch.ops.prefixcache.rms_norm(x, torch.randn(8).double(), EPS)
