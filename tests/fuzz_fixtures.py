"""Schemathesis against a live server: every operation of its /openapi.json, with inputs
valid and invalid by the schema; no 5xx, and every response as the schema declares it.

The cases come from schemathesis' Hypothesis strategies and run through Hypothesis here
(schemathesis' pytest integration, ``from_fixture``/``parametrize``, fails under pytest 9).
Used by ``tests/test_fuzz_api.py`` and, with many more examples, ``benchmarks/fuzz_nightly.py``.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def fuzz_operation(operation, base_url: str, headers: dict, mode: GenerationMode, examples: int):
    """``examples`` cases of ``operation`` in ``mode``, each sent and checked (no shrinking:
    the first failure is reported as found)."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        if isinstance(case.body, dict):
            short_generations(case.body, operation.path)
        case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS, timeout=60)

    run()


def short_generations(body: dict, path: str) -> None:
    """At most 4 tokens per completion, so that time goes to inputs, not to decoding (any
    other value of these fields is sent as generated); 2 when the body sets no limit."""
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if type(value) is int and value > 4:
            body[name] = 4
    body.setdefault("max_output_tokens" if path.endswith("/responses") else "max_tokens", 2)


SHARED_BODIES = {"POST /v1/messages/count_tokens": 4}  # its body is /v1/messages': a quarter


def fuzz(base_url: str, headers: dict, examples: int) -> list[str]:
    """Every operation with valid inputs, and with invalid ones where it has inputs that
    can be invalid (a string path parameter cannot); what ran, as "METHOD /path mode".
    An operation whose body another one's fuzzing covers gets a share of ``examples``
    (``SHARED_BODIES``)."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)
    ran = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            try:
                share = SHARED_BODIES.get(operation.label, 1)
                fuzz_operation(operation, base_url, headers, mode, max(1, examples // share))
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, operation.label
                continue
            ran.append(f"{operation.label} {mode.value}")
    return ran
