"""``response_format`` as OpenAI defines it, read into a ``JsonOutput`` (or nothing for text).

``{"type": "text"}`` (or absent): free text. ``{"type": "json_object"}``: any JSON object.
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``:
JSON matching ``schema`` (absent: any object). ``name`` is required, as OpenAI's (a-z, A-Z,
0-9, _ and -, at most 64); the schema is bounded by MAX_RESPONSE_SCHEMA_BYTES. The output
always follows the schema: ``strict`` is accepted and changes nothing.
"""

from __future__ import annotations

import re
from typing import Any

from prefixcache.protocol.constraints import JsonOutput, canonical_json
from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.limits import MAX_RESPONSE_SCHEMA_BYTES

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
SCHEMA_FIELD = "response_format.json_schema.schema"
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def response_format_constraint(value: Any) -> JsonOutput | None:
    """The constraint ``response_format`` asks for; ApiError 400 naming the bad field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("response_format", "must be an object with a 'type'")
    kind = value.get("type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(value) - allowed)
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad(
            "response_format.type",
            f"must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
        )
    if extra:
        raise _bad(f"response_format.{extra[0]}", f"is not a field of a {kind!r} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonOutput(None)
    return _json_schema(value.get("json_schema"))


def _json_schema(spec: Any) -> JsonOutput:
    """The ``json_schema`` object: its name checked, its schema bounded."""
    field = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _bad(field, "is required with type 'json_schema' and must be an object")
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise _bad(f"{field}.{extra[0]}", "is not a field of json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"{field}.name", "is required: 1 to 64 of a-z, A-Z, 0-9, _ and -")
    if not isinstance(spec.get("strict", False), bool | None):
        raise _bad(f"{field}.strict", "must be a boolean")
    if not isinstance(spec.get("description", ""), str | None):
        raise _bad(f"{field}.description", "must be a string")
    schema = spec.get("schema")
    if schema is None:
        return JsonOutput(None)
    if not isinstance(schema, dict):
        raise _bad(SCHEMA_FIELD, "must be a JSON object (a JSON schema)")
    text = canonical_json(schema)
    size = len(text.encode("utf-8"))
    if size > MAX_RESPONSE_SCHEMA_BYTES:
        raise _bad(SCHEMA_FIELD, f"is {size} bytes; at most {MAX_RESPONSE_SCHEMA_BYTES} allowed")
    return JsonOutput(text)


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
