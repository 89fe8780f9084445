"""torch.ops.prefixcache.rope_heads (models.llama.rotate_heads): the query and key heads, each
QK-normed when weights are given, then rotated, against the formulas in float64, and against
the torch ops it replaces.

Tolerance: a normed value is within (n / 2 + 4) * 2^-24 of exact, relative (as in
test_native_rms_norm.py, n = head_dim); the rotation adds two products and a sum, each one
rounding. So each output is within (n / 2 + 7) * 2^-24 * (|a cos| + |b sin|) of exact, where a
and b are the exact normed inputs it combines.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.models.llama import Rotary, apply_rope, rms_norm, rotate_heads

pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("native")]

EPS = 1e-6


def _normed(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    x = x.double()
    if weight is None:
        return x
    return x * (x.square().mean(-1, keepdim=True) + EPS).rsqrt() * weight.double()


def _assert_rotated(ours, qk, heads, cos, sin, norms) -> None:
    q_norm, k_norm = norms if norms is not None else (None, None)
    normed = torch.cat((_normed(qk[:, :heads], q_norm), _normed(qk[:, heads:], k_norm)), 1)
    swapped = normed.roll(normed.shape[-1] // 2, -1)
    exact = normed * cos.double() + swapped * sin.double()
    scale = normed.abs() * cos.double().abs() + swapped.abs() * sin.double().abs()
    bound = (qk.shape[-1] / 2 + 7) * 2**-24 * scale + 1e-30
    excess = (ours.double() - exact).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"exceeds the bound by {excess.max():.3g}"


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 6),
    heads=st.sampled_from([(1, 1), (4, 1), (9, 3), (2, 2)]),
    dim=st.sampled_from([2, 64, 128, 256]),
    qk_norm=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rotated_heads_match_the_formula(tokens, heads, dim, qk_norm, seed) -> None:
    """A slice of a fused qkv output (strided rows), positions far apart, both norm modes."""
    num_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * dim, generator=generator) * 3
    qk = qkv[:, : (num_heads + kv_heads) * dim].view(tokens, num_heads + kv_heads, dim)
    positions = torch.randint(0, 5000, (tokens,), generator=generator)
    rope = Rotary(dim, 10000.0, 16)(positions, torch.float32)
    norms = (torch.randn(dim, generator=generator), torch.randn(dim, generator=generator))
    used = norms if qk_norm else None
    ours = rotate_heads(qk, num_heads, rope, used, EPS)
    assert ours.shape == qk.shape and ours.is_contiguous()
    _assert_rotated(ours, qk, num_heads, *rope, used)


def test_it_gives_what_the_torch_ops_gave() -> None:
    """The eager models' former path: norms per head group, then apply_rope."""
    qkv = torch.randn(3, (4 + 2) * 256)
    qk = qkv[:, : 5 * 256].view(3, 5, 256)
    rope = Rotary(256, 1e6, 8)(torch.tensor([0, 7, 600]), torch.float32)
    q_norm, k_norm = torch.randn(256), torch.randn(256)
    torch_way = apply_rope(
        torch.cat((rms_norm(qk[:, :4], q_norm, EPS), rms_norm(qk[:, 4:], k_norm, EPS)), 1), *rope
    )
    torch.testing.assert_close(rotate_heads(qk, 4, rope, (q_norm, k_norm), EPS), torch_way)
    torch.testing.assert_close(rotate_heads(qk, 4, rope), apply_rope(qk, *rope))


def test_bad_inputs_are_refused_naming_the_problem() -> None:
    qk = torch.randn(2, 3, 8)
    cos = sin = torch.randn(2, 8)
    op = torch.ops.prefixcache.rope_heads
    with pytest.raises(RuntimeError, match="qk must be fp32"):
        op(qk.double(), cos, sin, 2, None, None, EPS)
    with pytest.raises(RuntimeError, match="qk must be fp32"):
        op(qk.transpose(1, 2), cos, sin, 2, None, None, EPS)
    with pytest.raises(RuntimeError, match=r"heads 4 outside 0\.\.3"):
        op(qk, cos, sin, 4, None, None, EPS)
    with pytest.raises(RuntimeError, match="come together"):
        op(qk, cos, sin, 2, torch.randn(8), None, EPS)
    with pytest.raises(RuntimeError, match="cos must be contiguous fp32 with at least 16"):
        op(qk, torch.randn(1, 8), sin, 2, None, None, EPS)
    with pytest.raises(RuntimeError, match="q_norm must be contiguous fp32"):
        op(qk, cos, sin, 2, torch.randn(4), torch.randn(8), EPS)
