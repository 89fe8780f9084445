"""Logprobs of generated and prompt tokens: values, cache on/off identity, the HTTP shapes."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

import loopback
from engine_fixtures import assert_pool_clean, run_to_completion, tiny_engine
from prefixcache.engine.sampling import SamplingParams
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle

PROMPT = list(range(300, 340))  # 10 blocks of 4


def _prompt_logprobs(engine, prompt, request_id="score", k=2):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=0, prompt_logprobs=k))
    return run_to_completion(engine)[request_id]


def test_prompt_logprobs_are_identical_with_the_cache_on_and_off():
    warm = tiny_engine()
    warm.add_request("warm", PROMPT, SamplingParams(temperature=0, max_tokens=2))
    run_to_completion(warm)
    on = _prompt_logprobs(warm, PROMPT)
    off = _prompt_logprobs(tiny_engine(enable_prefix_caching=False), PROMPT)
    assert on.num_cached_tokens == 0  # its own hit was skipped: every position was computed
    assert on.prompt_logprobs[0] is None and len(on.prompt_logprobs) == len(PROMPT)
    assert [(e.token_id, e.logprob, e.rank, e.top) for e in on.prompt_logprobs[1:]] == [
        (e.token_id, e.logprob, e.rank, e.top) for e in off.prompt_logprobs[1:]
    ]
    assert on.outputs[0].token_ids == [] and on.outputs[0].finish_reason == "length"
    warm.add_request("after", PROMPT + [7], SamplingParams(temperature=0, max_tokens=1))
    assert run_to_completion(warm)["after"].num_cached_tokens == 40  # what it computed is shared
    assert_pool_clean(warm)


def test_prompt_logprobs_survive_chunked_prefill():
    whole = _prompt_logprobs(tiny_engine(), PROMPT)
    chunked = _prompt_logprobs(tiny_engine(max_num_batched_tokens=8), PROMPT)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-9)


def test_generated_logprobs_are_the_models_own_and_ranked():
    engine = tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    engine.add_request("gen", PROMPT, params)
    out = run_to_completion(engine)["gen"].outputs[0]
    scored = _prompt_logprobs(tiny_engine(), PROMPT + out.token_ids, k=3).prompt_logprobs
    for i, entry in enumerate(out.logprobs):
        reference = scored[len(PROMPT) + i]
        assert entry.token_id == out.token_ids[i] and entry.rank == 1  # greedy: the top token
        assert math.isclose(entry.logprob, reference.logprob, abs_tol=1e-9)
        assert [t for t, _ in entry.top] == [t for t, _ in reference.top]
        assert entry.top[0] == (entry.token_id, entry.logprob) and len(entry.top) == 3


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(num_kv_blocks=256)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state


def test_chat_logprobs_and_top_logprobs_parse_in_the_openai_client(served):
    url, state = served
    api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    args = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
        "extra_body": {"ignore_eos": True},
    }
    reply = api.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 4 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in content) == (
        reply.choices[0].message.content
    )
    streamed = [
        t
        for chunk in api.chat.completions.create(**args, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    wait_idle(state)


def _complete(url: str, **body) -> dict:
    response = loopback.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_max_tokens_0_scores_the_prompt_and_batches_fan_out(served):
    url, state = served
    tokenizer = state.engine.tokenizer
    contexts = ["The answer is", "The answer is"]
    answers = [" yes", " no"]
    prompts = [tokenizer.encode(c + a) for c, a in zip(contexts, answers, strict=True)]
    scored = _complete(url, prompt=prompts, max_tokens=0, logprobs=1, echo=True, temperature=0)
    assert [c["index"] for c in scored["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, scored["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(prompt)
        assert choice["text"] == tokenizer.decode(prompt, skip_special_tokens=False)
        assert all(-100 < lp <= 0 for lp in logprobs["token_logprobs"][1:])
    # lm-evaluation-harness asks with max_tokens=1 and drops the last (generated) entry
    harness = _complete(url, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    for zero, one in zip(scored["choices"], harness["choices"], strict=True):
        assert one["logprobs"]["token_logprobs"][:-1] == zero["logprobs"]["token_logprobs"]
        assert len(one["logprobs"]["top_logprobs"][-1]) >= 1
    assert scored["usage"]["completion_tokens"] == 0
    wait_idle(state)


def test_completion_logprobs_stream_like_the_whole_response(served):
    url, _ = served
    body = {"prompt": "One two", "max_tokens": 6, "logprobs": 2, "temperature": 0}
    whole = _complete(url, **body, ignore_eos=True)["choices"][0]["logprobs"]
    parts = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with loopback.stream(
        "POST", url + "/v1/completions",
        json={"model": "tiny", **body, "ignore_eos": True, "stream": True}, timeout=60,
    ) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                for key in parts:
                    parts[key] += logprobs[key] if logprobs else []
    assert parts == {key: whole[key] for key in parts}
    assert whole["text_offset"][0] == 0 and len(whole["tokens"]) == 6


def test_logprob_limits_are_named(served):
    url, _ = served
    response = loopback.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 21}
    )
    assert response.status_code == 400 and "logprobs" in response.json()["error"]["message"]
    assert "20" in response.json()["error"]["message"]
    chat = loopback.post(
        url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert chat.status_code == 400 and "logprobs: true" in chat.json()["error"]["message"]


def test_prompt_logprobs_match_transformers_on_the_default_model():
    """Within 1e-4 nats per token, float32 on both sides (measured: 0.0, bit-identical)."""
    from engine_fixtures import default_engine, default_model, default_reference

    loaded = default_model()
    # The dequantized weights: the int4 default is not bit-exact (tests/test_quantized.py).
    engine = default_engine(quantized=False)
    prompt = loaded.tokenizer.encode("Paged attention reads keys and values through block tables.")
    ours = _prompt_logprobs(engine, prompt, k=5).prompt_logprobs
    reference = default_reference()
    with torch.inference_mode():
        logp = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor([entry.logprob for entry in ours[1:]])
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    assert [entry.top[0][0] for entry in ours[1:]] == logp[:-1].argmax(-1).tolist()
    assert_pool_clean(engine)
