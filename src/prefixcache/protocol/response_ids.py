"""Response ids that name the replica that stored them: ``resp_`` + instance + random part.

Each replica draws a random instance id at start (8 hex digits, in its ``/health``); the
ids of the responses it issues begin with it, so a router can send a request naming a
``previous_response_id`` to the one replica that holds that conversation, keeping no state.
"""

from __future__ import annotations

import secrets
import string

PREFIX = "resp_"
INSTANCE_CHARS = 8
RANDOM_BYTES = 12  # the id's secret part: 96 bits


def new_instance() -> str:
    """A replica's instance id, drawn once at start."""
    return secrets.token_hex(INSTANCE_CHARS // 2)


def is_instance(value: object) -> bool:
    """Whether ``value`` is an instance id as ``new_instance`` draws them."""
    return (
        isinstance(value, str)
        and len(value) == INSTANCE_CHARS
        and all(c in string.hexdigits.lower() for c in value)
    )


def response_id(instance: str) -> str:
    """A new response id of the replica ``instance``."""
    return f"{PREFIX}{instance}{secrets.token_hex(RANDOM_BYTES)}"


def instance_of(value: object) -> str | None:
    """The instance part of a response id; None for anything not shaped like one."""
    if not isinstance(value, str) or not value.startswith(PREFIX):
        return None
    part = value[len(PREFIX) : len(PREFIX) + INSTANCE_CHARS]
    return part if is_instance(part) and len(value) > len(PREFIX) + INSTANCE_CHARS else None
