"""The sampler: greedy, seeded draws, top-k/top-p truncation, parameter checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.sampling import SamplingParams, greedy, make_generator, sample


def logits_rows(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_rows()
    params = [SamplingParams(temperature=0)] * 3
    assert sample(logits, params, [make_generator(0)] * 3) == logits.argmax(-1).tolist()


# Few distinct values, so ties are common; infinities and NaN (torch's argmax takes a NaN).
LOGIT_VALUES = st.sampled_from([-1.5, 0.0, 0.25, 2.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda rows: st.lists(
    st.lists(LOGIT_VALUES, min_size=5, max_size=5), min_size=rows, max_size=rows)))  # fmt: skip
def test_greedy_picks_what_torch_argmax_picks_ties_and_nan_included(rows):
    logits = torch.tensor(rows, dtype=torch.float32)
    assert greedy(logits) == logits.argmax(dim=-1).tolist()
    assert greedy(logits.to(torch.bfloat16)) == logits.to(torch.bfloat16).argmax(-1).tolist()


def test_same_seed_same_draws_other_seed_other_draws():
    logits = logits_rows(rows=1)
    params = [SamplingParams(temperature=1.0)]
    draws = [
        [sample(logits, params, [g])[0] for _ in range(20)]
        for g in (make_generator(7), make_generator(7), make_generator(8))
    ]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_rows(rows=1)
    best = int(logits.argmax())
    for params in (
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
    ):
        generator = make_generator(3)
        assert {sample(logits, [params], [generator])[0] for _ in range(30)} == {best}


def test_top_k_limits_the_support():
    logits = logits_rows(rows=1)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    generator = make_generator(1)
    params = [SamplingParams(temperature=2.0, top_k=5)]
    assert {sample(logits, params, [generator])[0] for _ in range(300)} <= allowed


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = make_generator(2)
    params = [SamplingParams(temperature=1.0, top_p=0.7)]
    seen = {sample(logits, params, [generator])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 2 and 3 are cut


def test_frequencies_follow_the_softmax():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None]
    generator = make_generator(4)
    params = [SamplingParams(temperature=1.0)]
    counts = torch.bincount(
        torch.tensor([sample(logits, params, [generator])[0] for _ in range(3000)]), minlength=3
    )
    assert torch.allclose(counts / 3000, probs, atol=0.04)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be in"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -1}, "temperature must be 0 \\(greedy\\) or in"),
        ({"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or in \[1e-06, 2.0\]"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_p": 1e-300}, r"top_p must be in \[1e-06, 1\]"),
        ({"repetition_penalty": 5e-324}, r"repetition_penalty must be in \[0.01, 10.0\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"seed": -5}, "seed must be in"),
        ({"stop": [""]}, "stop must be"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be"),
    ],
)
def test_bad_params_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="\n").stop == ["\n"]
