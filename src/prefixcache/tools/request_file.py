"""Request files for the debugging tools: token ids, a prompt or chat messages, plus keys.

``{"token_ids": [...]}``, ``{"prompt": "..."}`` or ``{"messages": [...]}``, with optional
``cache_salt``, ``lora_name`` and ``namespace`` (``{"model", "revision", "dtype"}``).
Errors name the file (and line) and the field, in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.cache.hashing import MAX_TOKEN_ID

if TYPE_CHECKING:
    from prefixcache.engine.tokenizer import Tokenizer

PROMPT_FIELDS = ("token_ids", "prompt", "messages")
KEY_FIELDS = ("cache_salt", "lora_name", "namespace")
NAMESPACE_FIELDS = ("model", "revision", "dtype")


class InputError(ValueError):
    """A bad request file; the message names the file and the field."""


@dataclass(slots=True)
class RequestSpec:
    """One request as a file gave it; exactly one of token_ids, prompt, messages is set."""

    where: str
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    namespace: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # tool-specific fields, unchecked here

    @property
    def kind(self) -> str:
        """Which prompt field was given."""
        return next(name for name in PROMPT_FIELDS if getattr(self, name) is not None)

    @property
    def is_text(self) -> bool:
        return self.token_ids is None


def load_request_file(path: str | Path) -> RequestSpec:
    """One request from a JSON file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid JSON: {error}") from None
    return parse_request(data, str(path))


def parse_request(data: object, where: str, extra_fields: tuple[str, ...] = ()) -> RequestSpec:
    """Check a decoded request object; InputError names ``where`` and the bad field."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    allowed = PROMPT_FIELDS + KEY_FIELDS + extra_fields
    unknown = next((name for name in data if name not in allowed), None)
    if unknown is not None:
        raise InputError(f"{where}: field {unknown!r} is unknown (expected: {', '.join(allowed)})")
    given = [name for name in PROMPT_FIELDS if data.get(name) is not None]
    if len(given) != 1:
        found = " and ".join(given) or "none"
        raise InputError(f"{where}: fields token_ids/prompt/messages: give one (found {found})")
    spec = RequestSpec(where, extra={k: data[k] for k in extra_fields if k in data})
    setattr(spec, given[0], _CHECKS[given[0]](data[given[0]], where))
    for name in ("cache_salt", "lora_name"):
        value = data.get(name)
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}: field {name!r}: expected a string or null")
        setattr(spec, name, value)
    spec.namespace = _check_namespace(data.get("namespace") or {}, where)
    return spec


def _check_token_ids(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field 'token_ids': expected a non-empty list of integers")
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise InputError(
                f"{where}: field 'token_ids[{index}]': expected an integer in "
                f"[0, {MAX_TOKEN_ID}], got {json.dumps(token)[:20]}"
            )
    return value


def _check_prompt(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError(f"{where}: field 'prompt': expected a non-empty string")
    return value


def _check_messages(value: object, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field 'messages': expected a non-empty list of messages")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InputError(f"{where}: field 'messages[{index}]': expected an object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InputError(f"{where}: field 'messages[{index}].{key}': expected a string")
    return value


_CHECKS = {"token_ids": _check_token_ids, "prompt": _check_prompt, "messages": _check_messages}


def _check_namespace(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InputError(f"{where}: field 'namespace': expected an object")
    for name, item in value.items():
        if name not in NAMESPACE_FIELDS or not isinstance(item, str):
            raise InputError(
                f"{where}: field 'namespace.{name}': expected one of "
                f"{', '.join(NAMESPACE_FIELDS)} with a string value"
            )
    return dict(value)


def rendered_text(spec: RequestSpec, tokenizer: Tokenizer) -> str | None:
    """The text the tokenizer sees: the prompt, or the chat template's rendering."""
    if spec.prompt is not None:
        return spec.prompt
    if spec.messages is not None:
        try:
            return tokenizer.apply_chat_template(spec.messages)
        except ValueError as error:
            raise InputError(f"{spec.where}: field 'messages': {error}") from None
    return None


def tokenize(spec: RequestSpec, tokenizer: Tokenizer | None) -> list[int]:
    """Token ids as the server would make them (prompt with BOS, messages via template)."""
    if spec.token_ids is not None:
        return list(spec.token_ids)
    assert tokenizer is not None, "text needs a tokenizer"
    text = rendered_text(spec, tokenizer)
    return tokenizer.encode(text, add_special_tokens=spec.prompt is not None)
