"""response_format over HTTP: json_schema and json_object outputs parse, bad ones are 400s.

The tiny model's server checks the request side; the real default model speaks to the
openai SDK, unchanged (``chat.completions.parse`` with a pydantic model).
"""

from __future__ import annotations

import json
from enum import StrEnum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

import loopback
from engine_fixtures import default_engine, tiny_engine
from prefixcache.protocol.auth import Tenants
from prefixcache.protocol.limits import MAX_RESPONSE_SCHEMA_BYTES
from server_fixtures import running_server

USER = [{"role": "user", "content": "hi"}]
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_url():
    with running_server(tiny_engine(num_kv_blocks=128), Tenants(None)) as (url, _):
        yield url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return loopback.post(url + path, json={"model": "tiny", **body}, timeout=60)


def _schema_format(schema: object, name: str = "small") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_json_schema_output_matches_on_both_routes(tiny_url: str, path: str) -> None:
    body = {"messages": USER} if "chat" in path else {"prompt": "hi"}
    body |= {"response_format": _schema_format(SMALL), "max_tokens": 40, "seed": 7, "n": 2}
    reply = _post(tiny_url, path, body).json()
    for choice in reply["choices"]:
        text = choice["message"]["content"] if "chat" in path else choice["text"]
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and len(value) == 2
        assert choice["finish_reason"] == "stop"


def test_a_stream_carries_the_same_json(tiny_url: str) -> None:
    body = {"model": "tiny", "messages": USER, "response_format": _schema_format(SMALL)}
    body |= {"max_tokens": 40, "seed": 3}
    whole = _post(tiny_url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    api = openai.OpenAI(base_url=tiny_url + "/v1", api_key="x", max_retries=0)
    stream = api.chat.completions.create(**body, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole["content"] and json.loads(text)["n"] in (1, 2, 3)


@pytest.mark.parametrize(
    ("response_format", "field", "expected"),
    [
        ({"type": "xml"}, "response_format.type", "must be 'text', 'json_object' or"),
        ({"type": "json_schema"}, "response_format.json_schema", "is required"),
        (_schema_format(SMALL, name="has space"), "response_format.json_schema.name", "1 to 64"),
        (_schema_format(SMALL, name="x" * 65), "response_format.json_schema.name", "1 to 64"),
        (_schema_format([1]), "response_format.json_schema.schema", "must be a JSON object"),
        (
            _schema_format({"type": "string", "format": "no-such-format"}),
            "response_format.json_schema.schema",
            "no-such-format",
        ),
        (
            _schema_format({"enum": ["x" * 1000] * (MAX_RESPONSE_SCHEMA_BYTES // 1000 + 1)}),
            "response_format.json_schema.schema",
            f"at most {MAX_RESPONSE_SCHEMA_BYTES} allowed",
        ),
        ({"type": "text", "schema": {}}, "response_format.schema", "is not a field"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_the_field(
    tiny_url: str, response_format: dict, field: str, expected: str
) -> None:
    reply = _post(
        tiny_url, "/v1/chat/completions", {"messages": USER, "response_format": response_format}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and expected in error["message"] and field in error["message"]


class Priority(StrEnum):
    LOW = "low"
    HIGH = "high"


class Owner(BaseModel):
    name: str = Field(max_length=20)
    team: str = Field(max_length=20)


class Task(BaseModel):
    title: str = Field(max_length=40)
    priority: Priority
    tags: list[str] = Field(max_length=3)
    owner: Owner


@pytest.fixture(scope="module")
def real_api():
    with running_server(default_engine(), Tenants(None), model_name="smol") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_the_openai_sdk_parses_a_pydantic_model_on_the_real_model(real_api) -> None:
    ask = "Make a task: fix the login bug, high priority, tags bug and auth, owned by Ana (web)."
    completion = real_api.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": ask}],
        response_format=Task,
        max_tokens=120,
        temperature=0,
    )
    task = completion.choices[0].message.parsed
    assert isinstance(task, Task) and isinstance(task.owner, Owner)
    assert task.priority in (Priority.LOW, Priority.HIGH)


def test_json_object_is_valid_json_on_the_real_model(real_api) -> None:
    reply = real_api.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a JSON object with a key city."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
