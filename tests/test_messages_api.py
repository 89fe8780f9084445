"""Anthropic's Messages API (``POST /v1/messages``) through the anthropic SDK, unchanged, on
a real server on loopback: responses, streaming, auth and errors in Anthropic's shape, and
``cache_control`` breakpoints kept through another tenant's flood until their ttl ends."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace

import anthropic
import openai
import pytest

import loopback
from clock_fixtures import FakeClock
from engine_fixtures import assert_pool_clean, tiny_engine
from prefixcache.cache.retention import Keep
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.errors import error_body
from prefixcache.protocol.limits import Limits
from prefixcache.server.app import prepare_context
from prefixcache.server.messages import prepare_messages
from server_fixtures import running_server, wait_idle, write_key_file

ALPHA, BETA = "sk-alpha", "sk-beta"
SYSTEM = "You are the archivist of a small library. Answer briefly and cite the shelf. " * 2
DOCUMENT = "The third shelf holds atlases of rivers, bound in green cloth, from 1890. " * 2
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture
def keys(tmp_path):
    return Tenants.from_file(write_key_file(tmp_path))


def client(url: str, key: str = ALPHA) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def ask(url: str, key: str = ALPHA, system=SYSTEM, user: str = "Where are the atlases?", **kw):
    """One greedy, short Messages call (this SDK has no ``temperature`` argument: sent as
    an extra field, as a client of an older API version would)."""
    options = {"max_tokens": 3, "extra_body": {"temperature": 0.0}, **kw}
    return client(url, key).messages.create(
        model="tiny", system=system, messages=[{"role": "user", "content": user}], **options
    )


def marked_system(control: dict = ONE_HOUR) -> list[dict]:
    return [{"type": "text", "text": SYSTEM, "cache_control": control}]


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def flood(url: str, rounds: int = 12) -> None:
    """Tenant beta's distinct prompts, more tokens in all than the pool holds; each served."""
    for i in range(rounds):
        words = " ".join(f"crate{i}n{j}" for j in range(6))
        reply = ask(url, BETA, system=None, user=words)
        assert reply.usage.output_tokens > 0  # pins never keep another tenant out


def test_the_first_call_creates_the_cache_and_the_second_reads_the_system_prompt(keys):
    engine = tiny_engine(num_kv_blocks=128, retention_clock=FakeClock())
    with running_server(engine, keys) as (url, state):
        first = ask(url, system=marked_system())
        second = ask(url, system=marked_system(), user="Which shelf has rivers?")
        assert first.type == "message" and first.role == "assistant"
        assert first.content[0].type == "text" and first.model == "tiny"
        assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 3
        created = first.usage.cache_creation_input_tokens
        assert created > 0 and created % 4 == 0  # whole blocks of the system prompt
        assert first.usage.cache_creation.ephemeral_1h_input_tokens == created
        assert first.usage.cache_creation.ephemeral_5m_input_tokens == 0
        assert first.usage.cache_read_input_tokens == 0
        assert second.usage.cache_read_input_tokens >= created
        assert second.usage.cache_creation_input_tokens == 0
        prompt_length = len(state.engine.tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where are the atlases?"}]
        ))  # fmt: skip
        assert total_input(first.usage) == prompt_length
        # The same conversation as an OpenAI chat request reads the same cached blocks.
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key=ALPHA, max_retries=0)
        reply = chat.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
            max_tokens=2,
        )
        assert reply.usage.prompt_tokens_details.cached_tokens >= created
        wait_idle(state)
    assert_pool_clean(engine)


def test_a_1h_breakpoint_outlives_a_flood_the_unmarked_document_does_not_then_expires(keys):
    clock = FakeClock()
    engine = tiny_engine(num_kv_blocks=32, retention_clock=clock)  # 128 tokens
    with running_server(engine, keys) as (url, state):
        first = ask(url, system=marked_system(), user=DOCUMENT)
        kept = first.usage.cache_creation_input_tokens
        assert kept > 0 and state.engine.manager.retained_blocks() == kept // 4
        flood(url)
        again = ask(url, system=marked_system(), user=DOCUMENT)
        assert again.usage.cache_read_input_tokens == kept  # the system prompt, not the document
        assert again.usage.cache_creation_input_tokens == 0
        clock.now += 3601
        flood(url)
        late = ask(url, system=marked_system(), user=DOCUMENT)
        assert late.usage.cache_read_input_tokens == 0  # expired, then evicted
        assert late.usage.cache_creation_input_tokens == kept  # and retained anew
        wait_idle(state)
    assert_pool_clean(engine)


def test_pins_that_fill_the_pool_never_block_another_tenants_admission(keys):
    engine = tiny_engine(
        num_kv_blocks=32, retention_budgets={"alpha": 1.0}, retention_clock=FakeClock()
    )
    with running_server(engine, keys) as (url, state):
        long_system = [{"type": "text", "text": SYSTEM + DOCUMENT, "cache_control": ONE_HOUR}]
        pinned = ask(url, system=long_system)
        assert (
            state.engine.manager.retained_blocks() * 4 == pinned.usage.cache_creation_input_tokens
        )
        # beta's prompts (60 tokens) need 16 blocks: more than the 32 - 20 not retained
        assert state.engine.manager.retained_blocks() >= 20
        flood(url, rounds=3)  # beta is served: retained free blocks give way when needed
        wait_idle(state)
    assert_pool_clean(engine)


def test_the_budget_caps_what_one_tenant_retains(keys):
    engine = tiny_engine(
        num_kv_blocks=32, retention_budgets={"alpha": 0.25}, retention_clock=FakeClock()
    )
    with running_server(engine, keys) as (url, state):
        reply = ask(
            url, system=[{"type": "text", "text": SYSTEM + DOCUMENT, "cache_control": ONE_HOUR}]
        )
        assert reply.usage.cache_creation_input_tokens == 8 * 4  # 0.25 of 32 blocks
        assert state.engine.manager.retained_blocks() == 8
        assert state.engine.manager.stats.retention_refused > 0
        assert total_input(reply.usage) > 8 * 4
        wait_idle(state)
    assert_pool_clean(engine)


def test_5m_and_1h_breakpoints_split_the_creation_and_the_request_level_one_marks_the_end(keys):
    engine = tiny_engine(num_kv_blocks=128, retention_clock=FakeClock())
    with running_server(engine, keys) as (url, state):
        user = [
            {"type": "text", "text": DOCUMENT, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Which cloth?"},
        ]
        reply = client(url).messages.create(
            model="tiny", max_tokens=2, system=marked_system(),
            messages=[{"role": "user", "content": user}],
            cache_control={"type": "ephemeral", "ttl": "5m"},
        )  # fmt: skip
        usage = reply.usage
        one_hour, five_minutes = (
            usage.cache_creation.ephemeral_1h_input_tokens,
            usage.cache_creation.ephemeral_5m_input_tokens,
        )
        assert one_hour > 0 and five_minutes > 0
        assert usage.cache_creation_input_tokens == one_hour + five_minutes
        # the request-level breakpoint covers " Which cloth?" (to its last full block): left
        # are at most 3 tokens of that block and the template's tail after the content
        tail = state.engine.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
        assert usage.input_tokens <= 3 + len(tail)
        wait_idle(state)
    assert_pool_clean(engine)


def test_streaming_events_arrive_in_order_and_the_sdk_reassembles_the_text(keys):
    engine = tiny_engine(num_kv_blocks=128, retention_clock=FakeClock())
    with running_server(engine, keys) as (url, state):
        body = {
            "model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
            "system": marked_system(), "messages": [{"role": "user", "content": "Hello"}],
        }  # fmt: skip
        with loopback.stream(
            "POST", f"{url}/v1/messages", json=body, headers={"x-api-key": ALPHA}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
        events = [_parse_event(chunk) for chunk in raw.strip().split("\n\n")]
        names = [name for name, _ in events]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[3:-3]) == {"content_block_delta"}
        assert all(data["type"] == name for name, data in events)
        start, delta = events[0][1]["message"], events[-2][1]
        assert start["content"] == [] and start["usage"]["cache_creation_input_tokens"] > 0
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] == 6
        streamed = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
        whole = ask(url, system=marked_system(), user="Hello", max_tokens=6)
        assert streamed == whole.content[0].text
        with client(url).messages.stream(
            model="tiny", max_tokens=6, extra_body={"temperature": 0.0}, system=marked_system(),
            messages=[{"role": "user", "content": "Hello"}],
        ) as stream:  # fmt: skip
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert "".join(pieces) == final.content[0].text == whole.content[0].text
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
        assert final.usage.cache_read_input_tokens > 0
        wait_idle(state)
    assert_pool_clean(engine)


def _parse_event(chunk: str) -> tuple[str, dict]:
    """An SSE event as Anthropic sends it: ``event:`` then ``data:``."""
    event_line, data_line = chunk.split("\n")
    assert event_line.startswith("event: ") and data_line.startswith("data: ")
    return event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))


def test_a_stop_sequence_ends_the_text_and_is_reported(keys):
    engine = tiny_engine(num_kv_blocks=128)
    with running_server(engine, keys) as (url, state):
        text = ask(url, max_tokens=12).content[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = ask(url, max_tokens=12, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.find(stop)]
        wait_idle(state)


def test_x_api_key_works_and_a_bad_key_gets_anthropics_authentication_error(keys):
    engine = tiny_engine(num_kv_blocks=64)
    limits = Limits(max_body_bytes=4096)
    with running_server(engine, keys, limits=limits) as (url, state):
        assert ask(url, BETA).usage.output_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as failed:
            ask(url, "sk-wrong")
        assert failed.value.status_code == 401
        assert failed.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "invalid API key"},
        }
        bearer = loopback.post(
            f"{url}/v1/messages",
            json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
            headers={"authorization": f"Bearer {ALPHA}", "anthropic-version": "2023-06-01"},
        )
        assert bearer.status_code == 200 and bearer.json()["type"] == "message"
        missing = loopback.post(f"{url}/v1/messages", json={})
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        too_big = loopback.post(
            f"{url}/v1/messages", content=b"x" * 5000, headers={"x-api-key": ALPHA}
        )
        assert too_big.status_code == 413 and too_big.json()["type"] == "error"
        with pytest.raises(anthropic.NotFoundError) as unknown:
            client(url).messages.create(
                model="other", max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
        assert unknown.value.body["error"]["type"] == "not_found_error"
        wait_idle(state)


TEXT = {"type": "text", "text": "hi"}


def _with(*blocks: dict) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


def _marked(ttl: str) -> dict:
    return {**TEXT, "cache_control": {"type": "ephemeral", "ttl": ttl}}


BAD = [
    ({"messages": _with({"type": "image", "source": {}})}, "messages.0.content.0.type"),
    ({"system": [{"type": "document", "source": {}}]}, "system.0.type"),
    ({"messages": _with(*[_marked("5m")] * 5)}, "messages.0.content.4.cache_control"),
    ({"messages": _with(_marked("2h"))}, "messages.0.content.0.cache_control.ttl"),
    ({"messages": _with({**TEXT, "cache_control": {"type": "persistent"}})},
     "messages.0.content.0.cache_control.type"),
    ({"messages": _with(_marked("5m"), _marked("1h"))}, "messages.0.content.1.cache_control.ttl"),
    ({"messages": _with(_marked("5m")), "cache_control": ONE_HOUR}, "cache_control.ttl"),
    ({"messages": _with({"type": "text"})}, "messages.0.content.0.text"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
]  # fmt: skip


@pytest.fixture(scope="module")
def plain_server():
    engine = tiny_engine(num_kv_blocks=64)
    with running_server(engine, Tenants(None)) as (url, state):
        yield url, state


@pytest.mark.parametrize(("change", "field"), BAD, ids=[field for _, field in BAD])
def test_every_bad_request_is_a_400_naming_its_field(plain_server, change, field):
    url, state = plain_server
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    body.update(change)
    if change.get("max_tokens", 1) is None:
        del body["max_tokens"]
    reply = loopback.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "k"})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{field}:"), error
    wait_idle(state)
    assert_pool_clean(state.engine)


def test_a_breakpoint_keeps_the_tokens_through_the_end_of_its_block():
    engine = tiny_engine()
    ctx = prepare_context(engine, "tiny")
    body = {
        "model": "tiny", "max_tokens": 2, "system": marked_system(),
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Where?", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Now."},
        ]}],
    }  # fmt: skip
    ready = prepare_messages(json.dumps(body).encode(), ctx)
    tokenizer = engine.tokenizer
    system_end = tokenizer.encode(f"<|im_start|>system\n{SYSTEM}")
    user_end = tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhere?")
    assert ready.retention == (
        Keep(len(system_end), 3600, "1h"),
        Keep(len(user_end), 300, "5m"),
    )
    assert ready.prompts[0][: len(user_end)] == user_end


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"), (401, "authentication_error"),
        (403, "permission_error"), (404, "not_found_error"), (413, "invalid_request_error"),
        (429, "rate_limit_error"), (503, "overloaded_error"), (500, "api_error"),
    ],
)  # fmt: skip
def test_errors_take_anthropics_shape_on_its_route_and_openais_elsewhere(status, kind):
    assert error_body(status, "no", "field", "/v1/messages") == {
        "type": "error",
        "error": {"type": kind, "message": "no"},
    }
    assert error_body(status, "no", "field", "/v1/chat/completions")["error"]["param"] == "field"


def test_breakpoints_are_found_under_a_template_that_trims_the_content():
    engine = tiny_engine()
    tokenizer = copy.copy(engine.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    tokenizer._template = None
    ctx = replace(prepare_context(engine, "tiny"), tokenizer=tokenizer)
    body = {
        "model": "tiny", "max_tokens": 2,
        "system": [{"type": "text", "text": "  Be brief.  ", "cache_control": ONE_HOUR}],
        "messages": [{"role": "user", "content": "Hi"}],
    }  # fmt: skip
    ready = prepare_messages(json.dumps(body).encode(), ctx)
    through = tokenizer.encode("<|im_start|>system\nBe brief.")
    assert ready.retention == (Keep(len(through), 3600, "1h"),)


def test_the_fronts_429_past_a_tenants_share_is_anthropics_rate_limit_error(keys):
    engine = tiny_engine(num_kv_blocks=64)
    limits = Limits(max_pending_per_tenant=1)
    with running_server(engine, keys, max_pending=8, limits=limits) as (url, state):
        step = state.engine.step

        def slow_step():  # on the engine thread: the held stream lasts seconds unless closed
            time.sleep(0.02)
            return step()

        state.engine.step = slow_step
        body = {"model": "tiny", "max_tokens": 200, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
        try:
            with loopback.stream(
                "POST", f"{url}/v1/messages", json=body, headers={"x-api-key": BETA}
            ) as held:
                lines = held.iter_lines()  # kept: closing it would close the stream
                assert next(lines) == "event: message_start"
                with pytest.raises(anthropic.RateLimitError) as refused:
                    ask(url, BETA)
        finally:
            del state.engine.step
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        assert ask(url, ALPHA).usage.output_tokens > 0  # another tenant is still served
        wait_idle(state)
    assert_pool_clean(engine)


def test_openai_cache_fields_on_a_messages_body_are_ignored_extras(plain_server):
    """A Messages body has no prompt_cache_retention: an odd value there is an unknown field,
    ignored like any other, never read as a retention class (it was a 500)."""
    url, state = plain_server
    body = {
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "prompt_cache_retention": "forever", "prompt_cache_key": 7,
    }  # fmt: skip
    reply = loopback.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "k"})
    assert reply.status_code == 200, reply.text
    wait_idle(state)
    assert_pool_clean(state.engine)
