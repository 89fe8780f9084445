"""Token counts and ids on the real default model, through the real SDKs: Anthropic's
``count_tokens`` equals the ``input_tokens`` of the same body's message, vLLM's
``/tokenize`` equals the ``prompt_tokens`` a completion of the same body prefills,
``/detokenize`` round-trips, and bad bodies get 4xx in each API's own error shape."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

import loopback
from engine_fixtures import default_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import Limits
from server_fixtures import running_server, wait_idle, write_key_file

MODEL = "smollm2"
KEY, OTHER = "sk-alpha", "sk-beta"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SYSTEM_BLOCKS = [
    {"type": "text", "text": "You answer in one short sentence."},
    {"type": "text", "text": "You work for a bike shop.", "cache_control": {"type": "ephemeral"}},
]
CONVERSATION = [
    {"role": "user", "content": "Is it raining in Oslo?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "light rain, 9 C"},
    ]},
]  # fmt: skip
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tenants = Tenants.from_file(write_key_file(tmp_path_factory.mktemp("keys")))
    limits = Limits(max_pending_per_tenant=1)
    engine = default_engine()
    with running_server(engine, tenants, model_name=MODEL, limits=limits) as (url, state):
        yield url, state
        wait_idle(state)


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"system": SYSTEM_BLOCKS, "messages": [{"role": "user", "content": "Hello"}]},
        {"system": "Be brief.", "messages": CONVERSATION, "tools": [WEATHER]},
        {"messages": CONVERSATION[:1], "tools": [WEATHER], "tool_choice": {"type": "auto"}},
    ],
    ids=["plain", "system-blocks", "tools-and-results", "tools"],
)
def test_count_tokens_equals_the_input_tokens_of_the_message(served, fields):
    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    counted = client.messages.count_tokens(model=MODEL, **fields)
    used = client.messages.create(model=MODEL, max_tokens=1, **fields).usage
    # Anthropic's usage splits the prompt: input_tokens are those neither read from nor
    # written to the cache; count_tokens is the whole prompt, as Anthropic's is
    cached = used.cache_creation_input_tokens + used.cache_read_input_tokens
    assert counted.input_tokens == used.input_tokens + cached > 0


def test_count_tokens_grows_with_tools_and_errs_in_anthropics_shape(served):
    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "Hello"}]
    bare = client.messages.count_tokens(model=MODEL, messages=ask).input_tokens
    tooled = client.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER])
    assert tooled.input_tokens > bare
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert empty.value.body["type"] == "error" and "messages" in empty.value.message
    with pytest.raises(anthropic.NotFoundError) as other:
        client.messages.count_tokens(model="gpt-9", messages=ask)
    assert other.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as choice:
        client.messages.count_tokens(
            model=MODEL, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "x"}
        )
    assert "tool_choice" in choice.value.message
    stranger = anthropic.Anthropic(base_url=url, api_key="sk-nobody", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        stranger.messages.count_tokens(model=MODEL, messages=ask)
    assert refused.value.body["error"]["type"] == "authentication_error"


def tokenize(url: str, body: dict, key: str = KEY) -> httpx.Response:
    return loopback.post(url + "/tokenize", json=body, headers={"Authorization": f"Bearer {key}"})


def detokenize(url: str, tokens: list) -> httpx.Response:
    return loopback.post(url + "/detokenize", json={"tokens": tokens}, headers=AUTH)


@pytest.mark.parametrize("tools", [[], CHAT_TOOLS], ids=["plain", "tools"])
def test_chat_tokenize_equals_the_prompt_a_chat_completion_prefills(served, tools):
    url, state = served
    body = {"model": MODEL, "messages": CHAT, "tools": tools} if tools else {"messages": CHAT}
    reply = tokenize(url, body)
    assert reply.status_code == 200, reply.text
    ids = reply.json()
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    extra = {"tools": tools, "tool_choice": "none"} if tools else {}
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, **extra)
    assert ids["count"] == len(ids["tokens"]) == chat.usage.prompt_tokens
    assert ids["max_model_len"] == state.engine.max_model_len
    text = detokenize(url, ids["tokens"]).json()["prompt"]
    assert "Name a prime number." in text
    assert (
        tokenize(url, {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        == (ids["tokens"])
    )  # the rendered text tokenizes back to the same ids


def test_prompt_tokenize_equals_a_completions_prompt_and_round_trips(served):
    url, _ = served
    prompt = "The quick brown fox, naïvely: 3.14 ≈ π! "
    ids = tokenize(url, {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"] and all(ids["token_strs"])
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    done = api.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert ids["count"] == done.usage.prompt_tokens
    bare = tokenize(url, {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert detokenize(url, bare).json() == {"prompt": prompt}
    other = tokenize(url, {"prompt": prompt}, key=OTHER).json()  # any tenant: the same ids
    assert other["tokens"] == ids["tokens"]


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/tokenize", {}, 400, "body", "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "body", "exactly one"),
        ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model", "smollm2"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, 400,
         "add_generation_prompt", "assistant's turn"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400,
         "add_special_tokens", "must be false"),
        ("/tokenize", {"prompt": "a", "tools": CHAT_TOOLS}, 400, "tools", "messages"),
        ("/tokenize", {"prompt": "word " * 9000}, 400, "prompt", "context is 8192"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
         400, "messages.0.tool_call_id", "answers no tool call"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens.1", "greater than or equal to 0"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens", "vocabulary [0, 49152)"),
        ("/detokenize", {"tokens": [1] * 8193}, 400, "tokens", "at most 8192"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0", "integer"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "list"),
    ],
)  # fmt: skip
def test_bad_token_bodies_are_openai_errors_naming_the_field(served, path, body, status, param,
                                                             words):  # fmt: skip
    url, _ = served
    reply = loopback.post(url + path, json=body, headers=AUTH)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_tokenize_needs_a_key_and_counts_against_the_tenants_share(served):
    url, state = served
    assert loopback.post(url + "/tokenize", json={"prompt": "a"}).status_code == 401
    long = {"model": MODEL, "prompt": "Count", "max_tokens": 4000, "ignore_eos": True}

    async def scenario() -> tuple[int, int, int]:
        async with loopback.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as s:
                lines = s.aiter_lines()  # kept: a dropped iterator would close the stream
                await anext(lines)  # alpha's one unit is held by the stream
                mine = await http.post("/tokenize", json={"prompt": "a"})
                count = await http.post(
                    "/v1/messages/count_tokens",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "a"}]},
                )
                other = await http.post(
                    "/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer sk-beta"}
                )
            return mine.status_code, count.status_code, other.status_code

    assert asyncio.run(scenario()) == (429, 429, 200)
    wait_idle(state)
