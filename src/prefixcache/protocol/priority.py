"""A request's ``priority`` (vLLM's meaning: a lower number is scheduled first; default 0).

The body's field is checked against the server's limits here; a tenants file may give a
tenant its own default (``priority``) and the most urgent number it may ask for
(``min_priority``): a request asking for less is refused, naming both.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
PRIORITY_HELP = (
    f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]: lower is scheduled first, and may pause "
    "a running prefill of a higher number (default 0, or the tenant's)"
)


class PriorityField(BaseModel):
    """The ``priority`` of a request body (None: the tenant's default)."""

    priority: int | None = Field(
        None, ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True, description=PRIORITY_HELP
    )


def check_priority(value: object, what: str) -> int:
    """An integer in the limits, or ValueError naming ``what`` and the limits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{what} {value} is outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    return value


def request_priority(asked: int | None, default: int, floor: int) -> int:
    """The priority a request runs at: what it asked (else the default), not below ``floor``;
    ValueError if it asked for a more urgent number than its tenant may."""
    if asked is None:
        return default
    if asked < floor:
        raise ValueError(
            f"priority {asked} is below this tenant's min_priority {floor} (lower runs first)"
        )
    return asked
