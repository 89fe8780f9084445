"""Chat templates: compiled in a Jinja2 sandbox with transformers' helpers, rendered within
bounds, and checked once before a server takes requests.

A template comes from the model file or the operator, so it may be hostile: the sandbox
(``ImmutableSandboxedEnvironment``) refuses private attributes and mutation, and rendering
is bounded two ways, because Python cannot stop a thread from outside:

- size: every string or list the template builds (``~``, ``+``, ``*``, ``%``, a filter's or a
  method's result) and the output are capped at ``MAX_TEMPLATE_CHARS``; a number argument
  above it (``center(10**9)``, ``'%999999999d'``) and ``range()`` beyond ``MAX_RANGE`` items
  are refused before they allocate.
- time: a trace function on the rendering thread, set for the template's own frames only,
  checks the thread's CPU time at each line, so any loop the template runs (however nested,
  however empty) stops at ``RENDER_CPU_SECONDS``; loops inside a filter are bounded by the
  size caps. CPU time, not wall time, so a loaded server never fails a slow-but-fine render.

Every failure is a ``ValueError`` of one line; the server answers it with a 400.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import wraps
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_CHARS = 1 << 24  # any string or list a template builds, its output included
MAX_RANGE = 100_000  # items of one range()
RENDER_CPU_SECONDS = 1.0  # CPU time of one render
SAMPLE = [{"role": "user", "content": "Hello! What can you do?"}]
SAMPLE_MAX_CHARS = 1 << 16  # a one-message conversation rendered at start-up
NO_TEMPLATE = (
    "this model has no chat template (it may be a base model): use /v1/completions, or start "
    "the server with --chat-template FILE (a Jinja chat template)"
)
_NUMBER = re.compile(r"\d+")
_CHECK_EVERY = 64


class NoChatTemplate(ValueError):
    """The model has no chat template and none was given."""

    def __init__(self) -> None:
        super().__init__(NO_TEMPLATE)


class TemplateFailed(ValueError):
    """A chat template failed, was refused by the sandbox, or went past a bound."""


class _Rejected(jinja2.TemplateError):
    """The template's own ``raise_exception``: it does not support these messages."""


class _OverBound(Exception):
    """A render went past a size or time bound."""


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join (the sandbox has no hook for it)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.sized(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every way a template can build something large or loop capped."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.filters["tojson"] = _bounded(_tojson)
        self.filters["format"] = _bounded(_format)
        kept = ("dict", "namespace", "cycler", "joiner")  # lipsum(n) loops n times unchecked
        self.globals = {
            **{name: _bounded(self.globals[name]) for name in kept},
            "range": _range,
            "raise_exception": _raise_exception,
            "strftime_now": lambda fmt: datetime.now().strftime(fmt),
        }

    @staticmethod
    def sized(value: Any) -> Any:
        """``value`` if it is within ``MAX_TEMPLATE_CHARS``; _OverBound otherwise."""
        if isinstance(value, str | list | tuple | dict) and len(value) > MAX_TEMPLATE_CHARS:
            raise _OverBound(f"it built a value of {len(value):,} items")
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _huge_power(left, right):
            raise _OverBound(f"{left!r} ** {right!r} is too large")
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                repeated = isinstance(sequence, str | list | tuple) and isinstance(count, int)
                if repeated and len(sequence) * count > MAX_TEMPLATE_CHARS:
                    raise _OverBound(f"it repeated a value {count:,} times")
        if operator == "%" and isinstance(left, str):
            _check_numbers(left)
        return self.sized(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_argument(value)
        return __self.sized(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` as the sandbox wraps it, refused for a width beyond the cap."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_numbers(str(value.__self__))
        return wrapped


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in a ``BoundedEnvironment``; TemplateFailed for bad syntax."""
    try:
        return BoundedEnvironment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateFailed(f"the chat template does not compile: {_one_line(exc)}") from None


def render(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """The template's output for ``context``, within the bounds; a one-line ValueError else."""
    deadline = time.thread_time() + RENDER_CPU_SECONDS
    previous = sys.gettrace()
    sys.settrace(_tracer(deadline))
    try:
        return _collect(template.generate(**context))
    except _Rejected as exc:
        raise TemplateFailed(f"the chat template rejected the messages: {_one_line(exc)}") from None
    except _OverBound as exc:
        raise TemplateFailed(f"the chat template went past its bounds: {exc}") from None
    except RecursionError:
        raise TemplateFailed("the chat template recursed too deeply") from None
    except Exception as exc:  # a sandbox refusal, an undefined name, a type error...
        kind = type(exc).__name__
        raise TemplateFailed(f"the chat template failed ({kind}): {_one_line(exc)}") from None
    finally:
        sys.settrace(previous)


def check_template(template: jinja2.Template, special_tokens: Mapping[str, str]) -> None:
    """Refuse a template that cannot render a one-message conversation within bounds (and
    ``SAMPLE_MAX_CHARS``), or leaves its content out: what a server checks at start-up."""
    context = {"messages": SAMPLE, "add_generation_prompt": True, **special_tokens}
    text = render(template, context)
    if len(text) > SAMPLE_MAX_CHARS:
        raise TemplateFailed(
            f"the chat template wrote {len(text):,} characters for a one-message conversation "
            f"(at most {SAMPLE_MAX_CHARS:,})"
        )
    if SAMPLE[0]["content"] not in text:
        raise TemplateFailed("the chat template does not write the messages' content")


def _collect(chunks: Any) -> str:
    """The output's pieces joined, stopping once they pass ``MAX_TEMPLATE_CHARS``."""
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_TEMPLATE_CHARS:
            raise _OverBound(f"its output passed {MAX_TEMPLATE_CHARS:,} characters")
        parts.append(chunk)
    return "".join(parts)


def _tracer(deadline: float) -> Callable:
    """A trace function for the template's own frames that checks ``deadline`` every
    ``_CHECK_EVERY`` lines (reading the thread's CPU clock costs about a microsecond)."""
    lines = 0

    def line(frame: FrameType, event: str, arg: Any) -> Callable:
        nonlocal lines
        lines += 1
        if not lines % _CHECK_EVERY and time.thread_time() > deadline:
            raise _OverBound(f"it ran past {RENDER_CPU_SECONDS:g} s of CPU time")
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Callable | None:
        return line if frame.f_code.co_filename == "<template>" else None

    return call


def _bounded(function: Callable) -> Callable:
    """A filter or global whose number arguments and result are size-checked."""

    @wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_argument(value)
        return BoundedEnvironment.sized(function(*args, **kwargs))

    return bounded


def _range(*args: int) -> range:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise _OverBound(f"range() of {len(numbers):,} items (at most {MAX_RANGE:,})")
    return numbers


def _check_argument(value: Any) -> None:
    """A number passed to a call may not exceed ``MAX_RANGE`` (widths, counts, repeats: a
    filter's own loop is not traced, so its count is what bounds it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RANGE:
        raise _OverBound(f"a call was given {value:,} (at most {MAX_RANGE:,})")


def _check_numbers(format_text: str) -> None:
    """A format string may not ask for a width or precision beyond ``MAX_RANGE``."""
    if any(len(n) > 6 or int(n) > MAX_RANGE for n in _NUMBER.findall(format_text)):
        raise _OverBound(f"a format asks for a width beyond {MAX_RANGE:,}")


def _format(value: str, *args: Any, **kwargs: Any) -> str:
    """Jinja's ``format`` filter (``%`` formatting), its widths checked first."""
    _check_numbers(str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


def _huge_power(base: Any, exponent: Any) -> bool:
    if not isinstance(base, int | float) or not isinstance(exponent, int | float):
        return False
    if isinstance(base, float) or isinstance(exponent, float) or abs(base) < 2:
        return False
    return exponent > 0 and abs(base).bit_length() * exponent > 1 << 16


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _raise_exception(message: str) -> None:
    raise _Rejected(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping, as transformers' templates expect."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
