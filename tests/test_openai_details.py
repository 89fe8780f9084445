"""The OpenAI details real clients rely on: nulls, no-op values, batches, routes, errors,
streaming headers, and vLLM's metric names."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import loopback
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.protocol.auth import Tenants
from server_fixtures import running_server, wait_idle

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(num_kv_blocks=256, max_num_seqs=16)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return loopback.post(url + path, json={"model": "tiny", **body}, timeout=60)


def test_null_means_default(served):
    url, state = served
    nulls = {k: None for k in ("stream", "n", "temperature", "top_p", "stop", "seed", "user")}
    messages = [*USER, {"role": "assistant", "content": None}, *USER]
    chat = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, **nulls})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1
    text = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": None, **nulls})
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] <= 16
    wait_idle(state)


def test_no_op_values_are_accepted(served):
    url, state = served
    no_ops = {
        "response_format": {"type": "text"},
        "best_of": 1,
        "top_k": -1,
        "seed": -7,
        "tools": [],
        "logprobs": False,
        "presence_penalty": 0,
        "logit_bias": {},
    }
    reply = _post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **no_ops})
    assert reply.status_code == 200, reply.text
    text = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "best_of": 1, "seed": -1,
                                          "echo": False, "suffix": None})  # fmt: skip
    assert text.status_code == 200, text.text
    wait_idle(state)


def test_a_negative_seed_is_as_reproducible_as_any(served):
    url, _ = served
    body = {"prompt": "x", "max_tokens": 6, "temperature": 1.0, "seed": -42, "ignore_eos": True}
    first, second = (_post(url, "/v1/completions", body).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_batched_prompts_fan_out_into_choices_that_share_their_prefix(served):
    url, state = served
    shared = "A long shared preamble about railways and timetables. " * 4
    prompts = [shared + f"Question {i}?" for i in range(4)]
    api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    reply = api.completions.create(
        model="tiny", prompt=prompts, max_tokens=3, n=2, temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": "fan-out"},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == list(range(8))
    assert reply.usage.completion_tokens == 4 * 2 * 3
    assert reply.usage.prompt_tokens_details.cached_tokens >= 3 * 40  # 3 of 4 reuse the preamble
    ids = [state.engine.tokenizer.encode(p) for p in prompts[:2]]
    by_ids = api.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in by_ids.choices] == [reply.choices[0].text, reply.choices[2].text]
    streamed = {}
    for chunk in api.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=2,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):  # fmt: skip
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in reply.choices}
    wait_idle(state)
    assert_pool_clean(state.engine)


def test_models_routes_head_and_openai_shaped_404_405(served):
    url, _ = served
    assert loopback.get(url + "/v1/models/tiny").json() == {
        "id": "tiny", "object": "model", "created": 0, "owned_by": "prefixcache"
    }  # fmt: skip
    missing = loopback.get(url + "/v1/models/other")
    assert missing.status_code == 404 and "model 'other' does not exist" in missing.text
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/tiny"):
        head = httpx.head(url + path)
        assert head.status_code == 200 and head.content == b"", path
    nowhere = loopback.get(url + "/v1/nowhere")
    assert nowhere.status_code == 404
    assert nowhere.json()["error"]["type"] == "not_found_error"
    wrong = loopback.get(url + "/v1/chat/completions")
    assert (
        wrong.status_code == 405 and "method GET is not allowed" in wrong.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt: must be a string, a list of token ids"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt: prompt 0 must be a string or a list"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt: prompt 1 is empty"),
        ("/v1/completions", {"prompt": ["x"] * 65}, "at most 64 prompts"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop: must be a string or a list"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]},
         "messages.0.content: must be a string or a list of text parts"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "only text parts are supported"),
        ("/v1/chat/completions", {"messages": USER, "best_of": 3}, "best_of must equal n"),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}},
         "response_format.type: must be 'text', 'json_object' or 'json_schema'"),
        ("/v1/chat/completions", {"messages": USER, "presence_penalty": 3},
         "presence_penalty: Input should be less than or equal to 2"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"x": 1}},
         "logit_bias: keys must be token ids"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"99999999": 1}},
         "logit_bias token id 99999999 is outside the vocabulary"),
        ("/v1/chat/completions", {"messages": USER, "min_tokens": 9, "max_tokens": 3},
         "min_tokens must be in [0, max_tokens=3]"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0},
         "max_tokens: Input should be greater than or equal to 1"),
    ],
)  # fmt: skip
def test_validation_messages_name_the_field_never_a_union_branch(served, path, body, expected):
    url, _ = served
    response = _post(url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert expected in error["message"] and error["type"] == "invalid_request_error"
    for branch in ("str", "list[", "int]", "function-after", "union", "TextPart"):
        assert branch not in error["message"].split(":")[0], error["message"]


def test_streams_carry_no_buffering_headers(served):
    url, _ = served
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
    with loopback.stream("POST", url + "/v1/completions", json=body) as response:
        response.read()
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["content-type"].startswith("text/event-stream")


def test_vllm_metric_names_beside_ours(served):
    url, state = served
    _post(url, "/v1/completions", {"prompt": "metrics " * 10, "max_tokens": 3})
    wait_idle(state)
    families = {
        f.name: f for f in text_string_to_metric_families(loopback.get(url + "/metrics").text)
    }
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
        "vllm:num_preemptions", "vllm:cache_config_info",
        "prefixcache_prefix_cache_queries_tokens", "prefixcache_requests_running",
    ):  # fmt: skip
        assert name in families, name
    (idle,) = families["prefixcache_prefill_tokens_pending"].samples  # what routers weigh
    assert idle.value == 0
    queries = families["vllm:prefix_cache_queries"].samples[0]
    assert queries.name == "vllm:prefix_cache_queries_total" and queries.value > 0
    assert queries.labels == {"model_name": "tiny"}
    assert queries.value == families["prefixcache_prefix_cache_queries_tokens"].samples[0].value
    ttft = [
        s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")
    ]
    assert ttft[0].value >= 1
    config = families["vllm:cache_config_info"].samples[0].labels
    assert config["block_size"] == "4" and config["num_gpu_blocks"] == "256"
