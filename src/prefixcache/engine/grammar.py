"""A ``Constraint`` compiled to an llguidance grammar, and the matchers that follow it.

JSON output is compact with OpenAI's spacing (``{"a": 1, "b": [2, 3]}``: ", " and ": ",
no other whitespace), so a model cannot stall in whitespace. Tool calls are a Lark grammar:
``auto`` is free text without TOOL_CALL_OPEN then calls, ``required`` one or more calls,
``parallel=False`` at most one (whitespace around the JSON and between calls, at most
MAX_WHITESPACE characters each, MAX_END_WHITESPACE after the last); each call's JSON is
``{"name": ..., "arguments": ...}``
with the name one of the tools and the arguments that tool's schema. Compiled grammars are
cached by constraint (bounded LRU); a schema llguidance cannot compile is a ValueError whose
message is llguidance's, naming the unsupported part.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import llguidance

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.protocol.constraints import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Constraint,
    JsonOutput,
    ToolCalls,
)

CACHE_SIZE = 64
MAX_WHITESPACE = 16  # characters around a call's JSON and between calls: a model can't stall
MAX_END_WHITESPACE = 2  # after the last call: a model that pads before EOS stops soon
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's exact bytes, EOS, specials."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        added = tokenizer.backend.get_added_tokens_decoder()
        self.special_token_ids = [i for i, token in added.items() if token.special]

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@lru_cache(maxsize=4)
def llg_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it, built once per tokenizer (~0.3 s)."""
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer))
    eos = list(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size, eos_token=eos)


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) a constraint stands for."""
    if isinstance(constraint, JsonOutput):
        if constraint.schema_json is None:
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_STYLE)
        schema = closed_objects(json.loads(constraint.schema_json))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    if isinstance(constraint, ToolCalls):
        return llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(constraint))
    raise TypeError(f"not a constraint: {type(constraint).__name__}")


def tool_calls_lark(constraint: ToolCalls) -> str:
    """Lark for text and/or ``<tool_call>{...}</tool_call>`` calls, as ``constraint`` allows."""
    if not constraint.tools:
        raise ValueError("tools must name at least one tool")
    more = "(WS? call)*" if constraint.parallel else ""
    if constraint.mode == "required":
        start = f"start: WS? call {more} END_WS?"
    else:  # text alone, or text ending in the first TOOL_CALL_OPEN, then that call's rest
        start = f"start: TEXT? | text_open call_rest {more} END_WS?"
    open_, close = json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)
    lines = [
        start,
        f"call: {open_} call_rest",
        f"call_rest: WS? call_json WS? {close}",
        f"text_open[lazy]: /(?s:.*){_regex_literal(TOOL_CALL_OPEN)}/",
        "call_json: " + " | ".join(f"tool_{i}" for i in range(len(constraint.tools))),
        f"WS: /[ \\t\\r\\n]{{1,{MAX_WHITESPACE}}}/",
        f"END_WS: /[ \\t\\r\\n]{{1,{MAX_END_WHITESPACE}}}/",
        f"TEXT: /(?s:.+)/ & ~/(?s:.*){_regex_literal(TOOL_CALL_OPEN)}(?s:.*)/",
    ]
    for i, tool in enumerate(constraint.tools):
        lines.append(f"tool_{i}: %json {json.dumps(_call_schema(tool.name, tool.parameters_json))}")
    return "\n".join(lines) + "\n"


def _call_schema(name: str, parameters_json: str) -> dict:
    """One call's JSON: this tool's name and arguments matching its parameters schema.

    The parameters' ``$defs``/``definitions`` move to the call's root, where their
    ``#/$defs/...`` references now point.
    """
    parameters = closed_objects(json.loads(parameters_json)) or dict(ANY_OBJECT)
    root = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        **root,
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,
    }


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_objects(schema: object) -> object:
    """``schema`` with every object that lists ``properties`` but says nothing of others
    closed (``additionalProperties: false``), as OpenAI's strict mode and xgrammar read it:
    open, a model that sees the schema in its prompt copies it into the arguments."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SUBSCHEMAS:
        if key in closed:
            closed[key] = closed_objects(closed[key])
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    if "properties" in closed and not {"additionalProperties", "patternProperties"} & closed.keys():
        closed["additionalProperties"] = False
    return closed


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark /regex/."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0


class GrammarCache:
    """Compiled grammars by constraint, least recently used dropped past ``size``.

    Each entry is a fresh matcher; a branch gets a ``deep_copy`` of it. Thread-safe: the
    server compiles on its preparation threads, the engine copies on its own.
    """

    def __init__(self, tokenizer: Tokenizer, size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self.stats = CacheStats()
        self._entries: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The compiled grammar of ``constraint``; ValueError naming what is unsupported."""
        with self._lock:
            found = self._entries.get(constraint)
            if found is not None:
                self.stats.hits += 1
                self._entries.move_to_end(constraint)
                return found
            self.stats.misses += 1
        matcher = compile_matcher(self.tokenizer, constraint)
        with self._lock:
            self._entries[constraint] = matcher
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A new matcher at the start of ``constraint``'s grammar."""
        return self.compile(constraint).deep_copy()


def compile_matcher(tokenizer: Tokenizer, constraint: Constraint) -> llguidance.LLMatcher:
    """Compile ``constraint`` (no cache); ValueError with llguidance's message on failure."""
    try:
        source = grammar_source(constraint)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the schema cannot be compiled: {exc}") from exc
    matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), source, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the schema cannot be compiled: {matcher.get_error()}")
    return matcher


_caches: dict[int, GrammarCache] = {}
_caches_lock = threading.Lock()


def grammar_cache(tokenizer: Tokenizer) -> GrammarCache:
    """The process's grammar cache for one tokenizer (the server and engine share it)."""
    with _caches_lock:
        cache = _caches.get(id(tokenizer))
        if cache is None or cache.tokenizer is not tokenizer:
            cache = _caches[id(tokenizer)] = GrammarCache(tokenizer)
        return cache
