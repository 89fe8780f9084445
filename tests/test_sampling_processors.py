"""Penalties, min_tokens, min_p and logit_bias, against reference implementations.

References: transformers' logits processors (repetition penalty, min-p, min new tokens,
sequence bias) and OpenAI's documented formula for presence and frequency penalties,
``mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty``.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import (
    History,
    SamplingParams,
    make_generator,
    process_logits,
    sample,
)

VOCAB = 64


def _case(seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    rng = random.Random(seed)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    return logits * 3, prompt, output


@pytest.mark.parametrize("seed", range(20))
def test_repetition_penalty_matches_transformers(seed):
    logits, prompt, output = _case(seed)
    penalty = 0.5 + seed / 10
    ours = process_logits(
        logits, SamplingParams(repetition_penalty=penalty), History(prompt, output)
    )
    ids = torch.tensor([prompt + output])
    reference = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[None].clone())[0]
    assert torch.allclose(ours, reference)


@pytest.mark.parametrize("seed", range(20))
def test_presence_and_frequency_penalties_match_openais_formula(seed):
    logits, prompt, output = _case(seed)
    presence, frequency = (seed % 5 - 2) / 1.0, (seed % 7 - 3) / 2.0
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = process_logits(logits, params, History(prompt, output))
    reference = logits.clone()
    for token in range(VOCAB):
        count = output.count(token)  # output tokens only, as OpenAI and vLLM count them
        reference[token] -= count * frequency + (count > 0) * presence
    assert torch.allclose(ours, reference)


@pytest.mark.parametrize("seed", range(10))
def test_logit_bias_matches_transformers_sequence_bias(seed):
    logits, prompt, output = _case(seed)
    rng = random.Random(seed)
    bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(5)}
    ours = process_logits(logits, SamplingParams(logit_bias=bias), History(prompt, output))
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    reference = processor(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(ours, reference)


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_masks_stop_tokens_like_transformers(generated):
    logits, prompt, _ = _case(generated)
    output, stops = [1] * generated, [3, 7]
    params = SamplingParams(min_tokens=3)
    ours = process_logits(logits, params, History(prompt, output, stops))
    processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, stops)
    reference = processor(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_keeps_the_support_transformers_keeps(min_p):
    logits, _, _ = _case(int(min_p * 100))
    reference = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits[None].float())
    allowed = set(torch.nonzero(reference[0] > float("-inf")).flatten().tolist())
    params = [SamplingParams(temperature=1.0, min_p=min_p)]
    generator = make_generator(0)
    seen = {sample(logits[None], params, [generator])[0] for _ in range(400)}
    assert seen <= allowed and (len(seen) > 1 or len(allowed) == 1)


def test_greedy_sees_the_processed_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0, logit_bias={2: 10.0})
    assert sample(logits, [params], [make_generator(0)], [History([0], [])]) == [2]
    repeat = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert sample(logits, [repeat], [make_generator(0)], [History([0], [1, 1])]) == [3]


def test_the_engine_honours_bias_min_tokens_and_penalties():
    engine = tiny_engine()
    eos = engine.tokenizer.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0})
    engine.add_request("eos-first", [5, 6, 7], forced)
    kept = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logit_bias={eos: 100.0})
    engine.add_request("min-tokens", [5, 6, 7], kept)
    biased = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logit_bias": {9: 30.0}}
    engine.add_request("repeats", [5, 6, 7], SamplingParams(**biased))
    fresh = SamplingParams(**biased, presence_penalty=2.0, frequency_penalty=2.0)
    engine.add_request("fewer-repeats", [5, 6, 7], fresh)
    done = run_to_completion(engine)
    assert done["eos-first"].token_ids == []
    assert done["eos-first"].outputs[0].finish_reason == "stop"
    assert len(done["min-tokens"].token_ids) == 5 and eos not in done["min-tokens"].token_ids
    assert done["repeats"].token_ids == [9] * 12
    penalised = done["fewer-repeats"].token_ids
    assert penalised[:3] == [9] * 3 and penalised.count(9) < 12  # 30 - 2 - 2 * count
    assert_pool_clean(engine)


def test_the_engine_rejects_a_bias_outside_the_vocabulary():
    engine = tiny_engine()
    with pytest.raises(ValueError, match="logit_bias token id 999999 is outside the vocabulary"):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={999999: 1.0}))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 3}, "presence_penalty must be in"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"logit_bias": {1: 101}}, "logit_bias must map"),
        ({"logprobs": 21}, "logprobs must be in"),
        ({"max_tokens": 0}, "0 only with prompt_logprobs"),
    ],
)
def test_bad_processor_params_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
