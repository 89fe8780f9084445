"""``prefixcache explain A B``: how much of request B reuses request A's cache, and why no more.
(``prefixcache explain --served ID --url URL``, why a served request waited, is
``explain_served.py``.)

A is cached through a real ``KVCacheManager`` (admit, commit, free), then ``match`` asks how
much of B it would serve. The report names the first miss (block and token position) and
its cause: differing token ids, a salt, LoRA or namespace, a prefix shorter than a block,
rule 10's cap, or a tokenization/template difference. With a sliding window (``--window``,
or a ``--model`` with window layers) it also replays A through a full and a window group
and names a window-caused miss (``explain_window.py``). No prompt text is printed unless
``--show-text``; token ids, positions and character offsets are.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from prefixcache.cache import KVCacheManager, Namespace
from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, cdiv
from prefixcache.cache.hashing import get_hash_function, namespace_digest
from prefixcache.model_names import MODEL_HELP
from prefixcache.tools.explain_window import measure_window_reuse, window_lines
from prefixcache.tools.request_file import (
    InputError,
    RequestSpec,
    load_request_file,
    rendered_text,
    tokenize,
)
from prefixcache.tools.text_diff import common_prefix, text_notes

WINDOW = 6  # tokens shown on each side of the first difference


@dataclass(slots=True)
class Side:
    """One request, tokenized: its ids and, when given as text, the text the tokenizer saw."""

    name: str
    spec: RequestSpec
    tokens: list[int]
    text: str | None = None
    offsets: list[tuple[int, int]] | None = None  # character span of each token


@dataclass(slots=True)
class Reuse:
    """What B would reuse after A was cached, with rule 10's cap and without it."""

    tokens: int
    uncapped: int


def add_explain_parser(commands: argparse._SubParsersAction) -> None:
    """The ``explain`` subcommand and its options."""
    parser = commands.add_parser(
        "explain",
        help="why request B does (not) reuse request A's cached blocks; with --served, what a "
        "server's finished request reused and why it waited",
    )
    parser.add_argument(
        "a", nargs="?", help="JSON request cached first: token_ids, prompt or messages"
    )
    parser.add_argument("b", nargs="?", help="JSON request looked up second")
    _add_served_options(parser)
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument("--model", help=f"the model, for its tokenizer: {MODEL_HELP}")
    parser.add_argument(
        "--show-text", action="store_true", help="also print decoded text pieces and salts"
    )
    parser.add_argument(
        "--window",
        type=int,
        metavar="TOKENS",
        help="sliding window of the model's window layers: also report B's hit once A's "
        "out-of-window pages are evicted (default: the --model's window; 0: none)",
    )
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with a window: A's last N tokens were its answer, decoded (its window is kept too)",
    )


def _add_served_options(parser: argparse.ArgumentParser) -> None:
    """``--served ID --url URL [--api-key KEY]`` instead of A and B."""
    from prefixcache.tools.top import DEFAULT_URL, add_key_option

    parser.add_argument(
        "--served",
        metavar="REQUEST_ID",
        help="instead of A B: a request the server at --url finished (its response id, as in "
        "the access log): its cache hit, first token and why it waited",
    )
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"with --served: the server (default {DEFAULT_URL})"
    )
    add_key_option(parser)
    parser.set_defaults(explain_parser=parser)


def run_explain(args: argparse.Namespace) -> int:
    """Load both requests, explain, print; exit 2 on a bad file or option."""
    if args.served is not None:
        if args.a is not None:
            args.explain_parser.error("give A B or --served REQUEST_ID, not both")
        from prefixcache.tools.explain_served import run_served

        return run_served(args)
    if args.b is None:
        args.explain_parser.error("the following arguments are required: a, b (or --served)")
    try:
        _check_options(args)
        specs = [load_request_file(args.a), load_request_file(args.b)]
        tokenizer = None
        if args.show_text or any(spec.is_text for spec in specs):
            from prefixcache.engine.model_files import load_tokenizer

            tokenizer = load_tokenizer(args.model)
        a, b = (build_side(n, spec, tokenizer) for n, spec in zip("AB", specs, strict=True))
        window = _window(args)
        _check_answer(args.answer_tokens, window, a)
    except (InputError, ValueError) as error:  # ValueError: a model file we cannot read
        print(f"prefixcache explain: {error}", file=sys.stderr)
        return 2
    lines = explain(a, b, args.block_size, tokenizer, args.show_text, window, args.answer_tokens)
    print("\n".join(lines))
    return 0


def _check_options(args: argparse.Namespace) -> None:
    """InputError naming a bad number and its limit."""
    if args.block_size < 1:
        raise InputError(f"--block-size {args.block_size} must be >= 1")
    if args.window is not None and args.window < 0:
        raise InputError(f"--window {args.window} must be >= 1 token (0: no window layers)")
    if args.answer_tokens < 0:
        raise InputError(f"--answer-tokens {args.answer_tokens} must be >= 0")


def _window(args: argparse.Namespace) -> int:
    """``--window``, else the window of ``--model``'s window layers (its GGUF metadata, no
    weights); 0: every layer is full."""
    if args.window is not None or args.model is None:
        return args.window or 0
    from prefixcache.engine.model_files import sliding_window

    return sliding_window(args.model)


def _check_answer(answer_tokens: int, window: int, a: Side) -> None:
    """An answer needs a window to matter and leaves A at least one prompt token."""
    if answer_tokens and not window:
        raise InputError(
            "--answer-tokens only matters with a window (--window, or a --model with window layers)"
        )
    if answer_tokens and answer_tokens >= len(a.tokens):
        raise InputError(
            f"--answer-tokens {answer_tokens} must be below A's {len(a.tokens)} tokens "
            "(its prompt needs at least one)"
        )


def build_side(name: str, spec: RequestSpec, tokenizer) -> Side:
    """Tokenize a request as the server would; keep the text's token offsets for diffs."""
    tokens = tokenize(spec, tokenizer)
    if not spec.is_text:
        return Side(name, spec, tokens)
    text = rendered_text(spec, tokenizer)
    encoding = tokenizer.backend.encode(text, add_special_tokens=spec.prompt is not None)
    return Side(name, spec, tokens, text, list(encoding.offsets))


def measure_reuse(a: Side, b: Side, block_size: int) -> Reuse:
    """Cache A in a real manager (computed, then freed), then ``match`` B; 0 across namespaces."""
    if _namespace(a, block_size) != _namespace(b, block_size):
        return Reuse(0, 0)
    manager = KVCacheManager(
        cdiv(len(a.tokens), block_size), block_size, namespace=_namespace(a, block_size)
    )
    seq = manager.admit("A", a.tokens, a.spec.cache_salt, a.spec.lora_name)
    assert seq is not None
    manager.commit(seq, len(a.tokens))
    manager.free(seq)
    keys = (b.spec.cache_salt, b.spec.lora_name)
    reuse = Reuse(
        manager.match(b.tokens, *keys), manager.match(b.tokens, *keys, cap_last_token=False)
    )
    manager.check_invariants()
    return reuse


def _namespace(side: Side, block_size: int) -> Namespace:
    return Namespace(**side.spec.namespace, block_size=block_size)


def explain(
    a: Side,
    b: Side,
    block_size: int,
    tokenizer,
    show_text: bool,
    window: int = 0,
    answer_tokens: int = 0,
) -> list[str]:
    """The report, line by line; with a ``window``, B's hit in a hybrid pool too."""
    reuse = measure_reuse(a, b, block_size)
    first = _first_difference(a.tokens, b.tokens)
    complete = reuse.tokens == len(b.tokens) // block_size * block_size > 0
    lines = [
        f"block size {block_size}: A has {_tokens_blocks(a, block_size)}, "
        f"B has {_tokens_blocks(b, block_size)}",
        f"reusable: {_plural(reuse.tokens // block_size, 'block')}, {reuse.tokens} tokens of "
        f"B's {len(b.tokens)} ({reuse.tokens / len(b.tokens):.0%})",
        _first_miss_line(b, reuse, block_size, complete),
        _first_difference_line(a, b, first, block_size),
    ]
    if not complete:
        lines += _reasons(a, b, reuse, block_size, first, show_text)
    if first is not None:
        lines += text_notes(a, b, first, tokenizer)
        lines += token_diff(a, b, first, tokenizer if show_text else None)
    if window:
        namespace = _namespace(a, block_size)
        hybrid = measure_window_reuse(a, b, namespace, window, answer_tokens, reuse.tokens)
        lines += window_lines(hybrid, len(b.tokens))
    return lines


def _first_miss_line(b: Side, reuse: Reuse, block_size: int, complete: bool) -> str:
    if complete:
        tail = len(b.tokens) - reuse.tokens
        return (
            f"first miss: none: every full block of B is reused; its last {tail} tokens "
            "(less than a block) are always computed"
        )
    miss = reuse.tokens // block_size
    end = min((miss + 1) * block_size, len(b.tokens)) - 1
    return f"first miss: block {miss} (token positions {miss * block_size}-{end})"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _tokens_blocks(side: Side, block_size: int) -> str:
    given = "token ids" if side.spec.token_ids is not None else side.spec.kind
    full = _plural(len(side.tokens) // block_size, "full block")
    return f"{len(side.tokens)} tokens ({full}, {given})"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Position of the first differing token; None if one is a prefix of the other."""
    common = common_prefix(a, b)
    return common if common < min(len(a), len(b)) else None


def _first_difference_line(a: Side, b: Side, first: int | None, block_size: int) -> str:
    if first is not None:
        return (
            f"first differing token: position {first} (block {first // block_size}, "
            f"offset {first % block_size})"
        )
    if len(a.tokens) == len(b.tokens):
        return "first differing token: none (the token ids are identical)"
    shorter, longer = ("A", "B") if len(a.tokens) < len(b.tokens) else ("B", "A")
    return f"first differing token: none ({shorter} is a prefix of {longer})"


def _reasons(
    a: Side, b: Side, reuse: Reuse, block_size: int, first: int | None, show_text: bool
) -> list[str]:
    """Why the first miss is where it is, most fundamental cause first."""
    miss = reuse.tokens // block_size
    keys = _key_difference(a, b, block_size, show_text)
    if keys:
        return [f"reason: {keys}: the chains start from different roots, nothing is shared"]
    if len(b.tokens) < block_size:
        return [
            f"reason: B has {len(b.tokens)} tokens, shorter than one block ({block_size}): "
            "only complete blocks are cacheable"
        ]
    if first is not None and first < (miss + 1) * block_size:
        return [
            f"reason: token ids differ at position {first}: A has {a.tokens[first]}, "
            f"B has {b.tokens[first]}"
        ]
    if reuse.uncapped > reuse.tokens:
        return [
            f"reason: rule 10 caps the reuse: B's last token (position {len(b.tokens) - 1}) is "
            "always computed for its logits, so the block holding it is not reused; without "
            f"the cap B would reuse {reuse.uncapped} tokens"
        ]
    return [
        f"reason: A has only {len(a.tokens) // block_size} full blocks ({len(a.tokens)} "
        "tokens): its partial last block was never cached (only complete blocks are)"
    ]


def _key_difference(a: Side, b: Side, block_size: int, show_text: bool) -> str | None:
    """The first non-token part of the key that differs: namespace, salt or LoRA."""
    ns_a, ns_b = _namespace(a, block_size), _namespace(b, block_size)
    if ns_a != ns_b:
        field = next(
            f for f in ("model", "revision", "dtype") if getattr(ns_a, f) != getattr(ns_b, f)
        )
        sha = get_hash_function("sha256")
        roots = [namespace_digest(ns, sha).hex()[:12] for ns in (ns_a, ns_b)]
        return (
            f"the namespaces differ in {field!r} ({getattr(ns_a, field)!r} vs "
            f"{getattr(ns_b, field)!r}; root digests {roots[0]} vs {roots[1]})"
        )
    salts = a.spec.cache_salt, b.spec.cache_salt
    if salts[0] != salts[1]:
        shown = f" ({salts[0]!r} vs {salts[1]!r})" if show_text else ""
        if None in salts:
            return f"cache_salt differs: only {'A' if salts[0] else 'B'} has one{shown}"
        return f"cache_salt differs{shown}"
    if a.spec.lora_name != b.spec.lora_name:
        return f"lora_name differs ({a.spec.lora_name!r} vs {b.spec.lora_name!r})"
    return None


def token_diff(a: Side, b: Side, first: int, tokenizer) -> list[str]:
    """Token ids around the first difference; decoded pieces only when given a tokenizer."""
    start = max(0, first - WINDOW)
    lines = [f"token ids around position {first} (| marks the first difference):"]
    for side in (a, b):
        ids = side.tokens[start : first + WINDOW]
        lines.append(f"  {side.name}[{start}:{start + len(ids)}]  {_marked(ids, first - start)}")
    if tokenizer is not None:
        for side in (a, b):
            ids = side.tokens[start : first + WINDOW]
            pieces = [repr(tokenizer.decode([t], skip_special_tokens=False)) for t in ids]
            lines.append(f"  {side.name} pieces  {_marked(pieces, first - start)}")
    return lines


def _marked(items: list, at: int) -> str:
    words = [str(item) for item in items]
    return " ".join(words[:at] + ["|"] + words[at:])
