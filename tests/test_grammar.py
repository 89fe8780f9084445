"""engine/grammar.py: constraints compile to llguidance grammars that accept the right text."""

from __future__ import annotations

import pytest

from engine_fixtures import default_tokenizer
from prefixcache.engine.grammar import GrammarCache
from prefixcache.protocol import tool_schemas
from prefixcache.protocol.constraints import JsonOutput, ToolCalls, ToolSpec, canonical_json

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = (ToolSpec("get_weather", canonical_json(WEATHER)), ToolSpec("noop", "{}"))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
NOOP = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache(default_tokenizer(), size=4)


def accepts(cache: GrammarCache, constraint: object, text: str) -> bool:
    """Whether the text's tokens are all allowed and leave the grammar complete."""
    matcher = cache.matcher(constraint)
    return matcher.consume_tokens(default_tokenizer().encode(text)) and matcher.is_accepting()


def test_a_schema_compiles_and_the_cache_counts_hits(cache: GrammarCache) -> None:
    schema = JsonOutput(canonical_json(WEATHER))
    before = (cache.stats.hits, cache.stats.misses)
    assert accepts(cache, schema, '{"city": "Oslo", "unit": "f"}')
    assert not accepts(cache, schema, '{"city": "Oslo", "unit": "k"}')
    assert not accepts(cache, schema, '{"unit": "f"}')
    assert (cache.stats.hits - before[0], cache.stats.misses - before[1]) == (2, 1)


def test_the_cache_is_bounded() -> None:
    small = GrammarCache(default_tokenizer(), size=2)
    for n in range(3):
        small.compile(JsonOutput(canonical_json({"type": "integer", "maximum": n})))
    assert len(small._entries) == 2
    small.compile(JsonOutput(canonical_json({"type": "integer", "maximum": 0})))
    assert small.stats.misses == 4


def test_no_schema_is_any_json_object(cache: GrammarCache) -> None:
    assert accepts(cache, JsonOutput(None), '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts(cache, JsonOutput(None), "[1, 2]")
    assert not accepts(cache, JsonOutput(None), "hello")


def test_an_unsupported_schema_names_the_part(cache: GrammarCache) -> None:
    with pytest.raises(ValueError, match="no-such-format"):
        cache.compile(JsonOutput(canonical_json({"type": "string", "format": "no-such-format"})))
    with pytest.raises(ValueError, match="/nowhere"):
        cache.compile(JsonOutput(canonical_json({"$ref": "#/nowhere"})))


@pytest.mark.parametrize(
    ("mode", "parallel", "text", "ok"),
    [
        ("auto", True, "Just text, no call.", True),
        ("auto", True, "", True),
        ("auto", True, "Let me check. " + CALL, True),
        ("auto", True, CALL + "\n" + NOOP + "\n", True),
        ("auto", True, "text <tool_call> unfinished", False),
        ("auto", True, CALL + " then more text", False),
        ("auto", False, CALL, True),
        ("auto", False, CALL + NOOP, False),
        ("required", True, CALL + NOOP, True),
        ("required", True, "  " + NOOP, True),
        ("required", True, "text first " + CALL, False),
        ("required", True, "", False),
        ("required", False, CALL, True),
        ("required", False, CALL + NOOP, False),
        ("required", True, CALL + "\n", True),  # a little padding before the end
        ("required", True, CALL + "\n\n\n", False),  # not more: a model must stop
        ("auto", False, CALL + "\n\n\n", False),
        ("auto", True, CALL.replace("get_weather", "get_time"), False),
        ("auto", True, CALL.replace('"Paris"', "3"), False),
    ],
)
def test_tool_calls_accept_and_reject(
    cache: GrammarCache, mode: str, parallel: bool, text: str, ok: bool
) -> None:
    assert accepts(cache, ToolCalls(TOOLS, mode, parallel), text) is ok  # type: ignore[arg-type]


def test_a_named_choice_is_exactly_one_call_even_with_parallel_calls_on(
    cache: GrammarCache,
) -> None:
    tools = [
        tool_schemas.FunctionDef(name="get_weather", parameters=WEATHER),
        tool_schemas.FunctionDef(name="noop"),
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    mode, name = tool_schemas.tool_choice(choice, tools)
    named = tool_schemas.constraint(tools, mode, name, parallel=True)
    assert named == ToolCalls((tools[0].spec(),), "required", parallel=False)
    assert accepts(cache, named, CALL)
    assert not accepts(cache, named, CALL + CALL)
    assert not accepts(cache, named, CALL + "\n" + CALL)
    assert not accepts(cache, named, NOOP)
    assert not accepts(cache, named, "")


def test_special_tokens_are_never_text(cache: GrammarCache) -> None:
    tokenizer = default_tokenizer()
    matcher = cache.matcher(JsonOutput(canonical_json(WEATHER)))
    assert matcher.consume_tokens(tokenizer.encode('{"city": "Os'))
    mask = matcher.compute_bitmask()
    allowed = [i for i in range(17) if mask[i // 8] >> (i % 8) & 1]
    assert allowed == []
    assert tokenizer.encode("lo")[0] in [
        i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1
    ]


def test_tool_parameters_may_refer_to_their_defs(cache: GrammarCache) -> None:
    parameters = {
        "$defs": {"Unit": {"enum": ["c", "f"]}},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
    }
    tools = (ToolSpec("temp", canonical_json(parameters)),)
    constraint = ToolCalls(tools, "required")
    assert accepts(
        cache, constraint, '<tool_call>{"name": "temp", "arguments": {"unit": "f"}}</tool_call>'
    )
    assert not accepts(
        cache, constraint, '<tool_call>{"name": "temp", "arguments": {"unit": "k"}}</tool_call>'
    )


def test_objects_that_list_properties_are_closed_unless_they_say_otherwise(
    cache: GrammarCache,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "inner": {"type": "object", "properties": {"b": {"type": "string"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "properties": {"const": {"properties": 1}},  # a property named so; a literal
        },
    }
    closed = JsonOutput(canonical_json(schema))
    assert accepts(cache, closed, '{"a": 1, "inner": {"b": "x"}, "open": {"z": 2}}')
    assert not accepts(cache, closed, '{"a": 1, "extra": 2}')
    assert not accepts(cache, closed, '{"inner": {"b": "x", "type": "integer"}}')
    assert accepts(cache, closed, '{"properties": {"properties": 1}}')
    assert accepts(cache, JsonOutput(None), '{"anything": [1]}')  # json_object stays open
