"""Workloads for ``prefixcache verify``: a built-in mix, or a JSONL file of requests.

A workload is a list of rounds; each round runs to completion before the next starts, so
later rounds can continue a conversation (``continues``: that request's prompt and first
completion, then this request's tokens) and hit blocks that earlier rounds left cached.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from prefixcache.cache.common import cdiv
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.tools.request_file import InputError, parse_request, tokenize

FILE_FIELDS = ("id", "max_tokens", "n", "seed", "temperature", "round", "continues")


@dataclass(slots=True)
class WorkItem:
    """One request of a workload: its own tokens, sampling, and the turn it continues."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    continues: str | None = None


Workload = list[list[WorkItem]]


def builtin_workload(vocab_size: int, num_requests: int, max_tokens: int, seed: int) -> Workload:
    """Shared system prefixes, two salts, seeded n=2 sampling, then a second turn for half."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(count)]

    systems = [tokens(rng.randrange(40, 100)) for _ in range(3)]
    first = []
    for index in range(num_requests):
        prompt = (rng.choice(systems) if rng.random() < 0.75 else []) + tokens(rng.randrange(1, 30))
        sampled = rng.random() < 0.25
        params = SamplingParams(
            n=2 if sampled else 1,
            temperature=0.8 if sampled else 0.0,
            seed=index if sampled else None,
            max_tokens=rng.randrange(2, max_tokens + 1),
            ignore_eos=True,
        )
        salt = "tenant-b" if rng.random() < 0.25 else None
        first.append(WorkItem(f"w{index}", prompt, params, salt))
    second = [
        WorkItem(
            f"{item.request_id}/2", tokens(3), _greedy(max_tokens), item.cache_salt, item.request_id
        )
        for item in first[: max(1, num_requests // 2)]
    ]
    return [first, second]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def load_workload(path: str | Path, tokenizer) -> Workload:
    """Rounds of requests from a JSONL file (blank lines skipped); InputError names the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    rounds: dict[int, list[WorkItem]] = {}
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if line.strip():
            where = f"{path} line {number}"
            round_index, item = _parse_line(line, where, tokenizer, number)
            _check_continues(item, round_index, seen, where)
            seen[item.request_id] = round_index
            rounds.setdefault(round_index, []).append(item)
    if not rounds:
        raise InputError(f"{path}: no requests")
    return [rounds[index] for index in sorted(rounds)]


def _parse_line(line: str, where: str, tokenizer, number: int) -> tuple[int, WorkItem]:
    """One workload line: (round, item)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: not valid JSON: {error}") from None
    spec = parse_request(data, where, FILE_FIELDS)
    if spec.lora_name is not None or spec.namespace:
        name = "lora_name" if spec.lora_name is not None else "namespace"
        raise InputError(f"{where}: field {name!r}: the engine has no LoRA or namespace option")
    extra = spec.extra
    max_tokens = _int_field(extra, "max_tokens", where, 16, 1)
    n = _int_field(extra, "n", where, 1, 1)
    round_index = _int_field(extra, "round", where, 0, 0)
    seed = _int_field(extra, "seed", where, None, 0)
    temperature = extra.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InputError(f"{where}: field 'temperature': expected a number >= 0")
    try:
        params = SamplingParams(
            n=n, temperature=float(temperature), seed=seed, max_tokens=max_tokens, ignore_eos=True
        )
    except ValueError as error:
        raise InputError(f"{where}: {error}") from None
    request_id = str(extra.get("id", f"line{number}"))
    item = WorkItem(request_id, tokenize(spec, tokenizer), params, spec.cache_salt)
    item.continues = extra.get("continues")
    return round_index, item


def _int_field(extra: dict, name: str, where: str, default: int | None, low: int) -> int | None:
    value = extra.get(name, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{where}: field {name!r}: expected an integer >= {low}")
    return value


def _check_continues(item: WorkItem, round_index: int, seen: dict[str, int], where: str) -> None:
    if item.request_id in seen:
        raise InputError(f"{where}: field 'id': {item.request_id!r} is used twice")
    if item.continues is not None and seen.get(item.continues, round_index) >= round_index:
        raise InputError(
            f"{where}: field 'continues': {item.continues!r} is not a request of an earlier round"
        )


def footprint(item: WorkItem, items: dict[str, WorkItem], block_size: int) -> int:
    """Blocks one branch of the request needs alone, at most (prompt, completion, 1 spare)."""
    total = max_prompt_length(item, items) + item.params.max_tokens
    return cdiv(total, block_size) + 1


def max_prompt_length(item: WorkItem, items: dict[str, WorkItem]) -> int:
    """The longest the prompt can be: earlier turns' prompts and completions included."""
    if item.continues is None:
        return len(item.token_ids)
    parent = items[item.continues]
    return max_prompt_length(parent, items) + parent.params.max_tokens + len(item.token_ids)
