"""Strict JSON for request bodies: UTF-8, finite numbers, bounded integers, containers and
nesting, no lone UTF-16 surrogates. Every refusal is a 400 that names the limit.

A body of a million empty arrays parses in C without a pause and makes the cyclic GC hold
the GIL for over a second, so a body whose brackets could exceed ``MAX_JSON_CONTAINERS``
is parsed by the pure-Python scanner instead, which counts them and stops at the limit.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import math
import re
from typing import Any

from prefixcache.protocol.errors import ApiError, field_path
from prefixcache.protocol.limits import MAX_INT_DIGITS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH

_SURROGATE = re.compile("[\ud800-\udfff]")  # json lets a lone "\ud800" through


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (NaN and Infinity are not allowed)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]!r} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer has {len(text)} digits; at most {MAX_INT_DIGITS} allowed")
    return int(text)


class _TooManyContainers(ValueError):
    pass


class _Decoder(json.JSONDecoder):
    def __init__(self) -> None:
        super().__init__(parse_float=_float, parse_int=_int, parse_constant=_constant)


class _CountingDecoder(_Decoder):
    """The pure-Python scanner, refusing the body at its ``MAX_JSON_CONTAINERS + 1``-th."""

    def __init__(self) -> None:
        super().__init__()
        self.containers = 0
        self.parse_object = self._object
        self.parse_array = self._array
        self.scan_once = json.scanner.py_make_scanner(self)

    def _count(self) -> None:
        self.containers += 1
        if self.containers > MAX_JSON_CONTAINERS:
            raise _TooManyContainers

    def _object(self, *args: Any) -> tuple[dict, int]:
        self._count()
        return json.decoder.JSONObject(*args)

    def _array(self, *args: Any) -> tuple[list, int]:
        self._count()
        return json.decoder.JSONArray(*args)


def load_json(raw: bytes) -> dict:
    """The body as a JSON object; ApiError(400) for anything else."""
    many = raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS  # counts inside strings too
    try:
        data = (_CountingDecoder() if many else _Decoder()).decode(raw.decode("utf-8"))
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except _TooManyContainers:
        message = f"request body has more than {MAX_JSON_CONTAINERS} arrays and objects"
        raise ApiError(400, message) from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    check_tree(data)
    return data


def check_tree(data: dict | list) -> None:
    """Nesting depth and lone surrogates (in values and keys), walked without recursion."""
    stack: list[tuple[dict | list, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            _refuse(path, f"nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                _refuse(path, "has a key with a lone UTF-16 surrogate (not valid Unicode)")
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    _refuse((*path, key), "contains a lone UTF-16 surrogate (not valid Unicode)")
            elif isinstance(item, dict | list):
                stack.append((item, (*path, key)))


def _refuse(path: tuple, reason: str) -> None:
    field = field_path(path)
    raise ApiError(400, f"{field}: {reason}", field)
