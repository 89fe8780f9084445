"""Synthetic traces: multi-turn conversations, shared system prompts, documents, tool calls.

A conversation starts at a Poisson arrival, picks a shared system prompt (Zipf popularity)
and runs a geometric number of user turns separated by think time. Each request resends
the whole history (system prompt, every earlier message and reply) plus the new message,
as chat clients do. A model reply may be a tool call: the tool's result follows after a
short gap, without a user message. A conversation may open with a document, and most of
those end after one question (one-shot documents).

Content is modelled as segments (a system prompt, one message, one reply): every segment
has its own token ids, derived from the seed and its number, so equal prefixes and only
equal prefixes give equal blocks. Output is our token-id format or the Mooncake format
(prefix-chained ids of 512-token blocks, the last one partial); each line's ``session`` is
its conversation's number. Same seed, same trace.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prefixcache.sim.traces import MOONCAKE_BLOCK_TOKENS, MooncakeRequest, TokenRequest, Trace

VOCAB = 49152  # SmolLM2's vocabulary: token ids in [0, VOCAB)
DECODE_MS_PER_TOKEN = 20.0  # how long a reply takes to stream, before the user thinks
LENGTH_SIGMA = 0.8  # spread of every lognormal length (mean kept as configured)
MAX_TURNS = 100  # no conversation runs longer
GAP_SIGMA = 1.2  # spread of think times: most replies are quick, a few come back hours later
TURN_TAILS = ("geometric", "pareto")
INF = float("inf")
KNOB_RANGES = [  # (knob, lowest, highest): a tool share of 1 would never end a turn
    *((name, 1, INF) for name in ("conversations", "system_tokens", "user_tokens")),
    *((name, 1, INF) for name in ("output_tokens", "tool_tokens", "doc_tokens")),
    ("system_prompts", 0, INF),
    ("system_zipf", 0.0, INF),
    ("mean_turns", 2.0, float(MAX_TURNS)),
    *((name, 1e-3, INF) for name in ("arrival_per_s", "turn_gap_s", "tool_gap_s")),
    *((name, 0.0, 1.0) for name in ("single_turn_share", "doc_share", "doc_one_shot")),
    ("tool_share", 0.0, 0.95),
]


@dataclass(slots=True, frozen=True)
class SynthConfig:
    """The knobs of one trace family (lengths in tokens, times in seconds)."""

    conversations: int = 2000
    arrival_per_s: float = 2.0  # new conversations per second (Poisson)
    system_prompts: int = 20  # distinct shared system prompts
    system_zipf: float = 1.0  # popularity skew of the system prompts
    system_tokens: int = 1500  # mean system prompt length
    single_turn_share: float = 0.5  # conversations that ask one question and leave
    mean_turns: float = 4.0  # user turns of the others (at least two)
    turn_tail: str = "geometric"  # or "pareto": the longer a conversation, the likelier it goes on
    user_tokens: int = 150  # mean user message
    output_tokens: int = 300  # mean model reply
    turn_gap_s: float = 60.0  # mean think time between a reply and the next message
    tool_share: float = 0.0  # chance that a reply is a tool call
    tool_tokens: int = 1000  # mean tool result
    tool_gap_s: float = 2.0  # mean time the tool takes
    doc_share: float = 0.0  # conversations that open with a document
    doc_tokens: int = 8000  # mean document
    doc_one_shot: float = 0.8  # document conversations with a single question
    seed: int = 0

    def __post_init__(self) -> None:
        for problem in self.problems():
            raise ValueError(problem)

    def problems(self) -> Iterator[str]:
        """One message per knob out of range."""
        for name, low, high in KNOB_RANGES:
            value = getattr(self, name)
            if not low <= value <= high:
                yield f"{name} must be in [{low}, {high}], got {value}"
        if self.turn_tail not in TURN_TAILS:
            yield f"turn_tail must be one of {list(TURN_TAILS)}, got {self.turn_tail!r}"


FAMILIES: dict[str, SynthConfig] = {
    "chat": SynthConfig(
        conversations=6000, arrival_per_s=3.0, system_prompts=30, system_tokens=1000,
        mean_turns=6.0, user_tokens=300, output_tokens=500, turn_gap_s=1200.0,
    ),
    "agent": SynthConfig(
        conversations=2500, arrival_per_s=1.5, system_prompts=8, system_tokens=4000,
        mean_turns=4.0, user_tokens=200, output_tokens=200, turn_gap_s=1200.0,
        tool_share=0.6, tool_tokens=1500,
    ),
    "docs": SynthConfig(
        conversations=5000, arrival_per_s=3.0, system_prompts=20, system_tokens=1000,
        mean_turns=4.0, user_tokens=200, output_tokens=400, turn_gap_s=1200.0,
        doc_share=0.5, doc_tokens=6000, doc_one_shot=0.8,
    ),
    "mixed": SynthConfig(
        conversations=4000, arrival_per_s=2.0, system_prompts=25, system_tokens=2500,
        mean_turns=5.0, user_tokens=250, output_tokens=400, turn_gap_s=1200.0,
        tool_share=0.3, tool_tokens=1200, doc_share=0.2, doc_tokens=6000, doc_one_shot=0.7,
    ),
}  # fmt: skip
MULTI_TURN_FAMILIES = ("chat", "agent", "mixed")


@dataclass(slots=True)
class SynthRequest:
    """One request: when, the segments of its input, and the segment it generates."""

    timestamp_ms: int
    segments: list[tuple[int, int]]  # (segment number, tokens), in order
    output: tuple[int, int]
    conversation: int = 0  # its conversation's number, in order of arrival


@dataclass(slots=True)
class _Conversation:
    """The state of one conversation while it is generated."""

    history: list[tuple[int, int]]
    clock_ms: float
    turns_left: int
    number: int = 0
    requests: list[SynthRequest] = field(default_factory=list)


class Generator:
    """Draws every random choice of one trace from a single seeded stream."""

    def __init__(self, config: SynthConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.next_segment = config.system_prompts
        self.system_lengths = [
            self.length(config.system_tokens) for _ in range(config.system_prompts)
        ]
        weights = [1.0 / (rank + 1) ** config.system_zipf for rank in range(config.system_prompts)]
        self.system_weights = list(_cumulative(weights))

    def length(self, mean: int) -> int:
        """A lognormal length with this mean (at least one token)."""
        mu = math.log(max(mean, 1)) - LENGTH_SIGMA**2 / 2
        return max(1, round(self.rng.lognormvariate(mu, LENGTH_SIGMA)))

    def segment(self, mean: int) -> tuple[int, int]:
        """A fresh segment of a lognormal length."""
        number = self.next_segment
        self.next_segment += 1
        return number, self.length(mean)

    def gap(self, mean_s: float) -> float:
        """A heavy-tailed think time (lognormal) with this mean, in seconds."""
        mu = math.log(max(mean_s, 1e-3)) - GAP_SIGMA**2 / 2
        return self.rng.lognormvariate(mu, GAP_SIGMA)

    def turns(self, mean: float) -> int:
        """User turns of a multi-turn conversation: at least two, with this mean.

        Pareto tail (the default): the longer a conversation has run, the likelier it goes
        on, as in public chat logs; geometric: every turn is the last with equal chance.
        """
        extra_mean = max(mean - 1.0, 1.0)
        if self.config.turn_tail == "geometric":
            count = 2
            while self.rng.random() >= 1.0 / extra_mean:
                count += 1
            return count
        alpha = extra_mean / (extra_mean - 1.0) if extra_mean > 1.0 else 8.0
        extra = int((1.0 - self.rng.random()) ** (-1.0 / alpha))
        return 1 + min(extra, MAX_TURNS - 1)

    def conversations(self) -> Iterator[_Conversation]:
        """Every conversation, fully generated, in order of arrival."""
        clock_s = 0.0
        for number in range(self.config.conversations):
            clock_s += self.rng.expovariate(self.config.arrival_per_s)
            yield self.conversation(clock_s * 1000.0, number)

    def conversation(self, start_ms: float, number: int = 0) -> _Conversation:
        """One conversation: system prompt, optional document, user turns with tool calls."""
        config = self.config
        history = []
        if config.system_prompts:
            prompt = self.rng.choices(
                range(config.system_prompts), cum_weights=self.system_weights
            )[0]
            history.append((prompt, self.system_lengths[prompt]))
        turns = 1 if self.rng.random() < config.single_turn_share else self.turns(config.mean_turns)
        if self.rng.random() < config.doc_share:
            history.append(self.segment(config.doc_tokens))
            turns = 1 if self.rng.random() < config.doc_one_shot else max(2, turns)
        conversation = _Conversation(history, start_ms, turns, number)
        while conversation.turns_left:
            self.user_turn(conversation)
        return conversation

    def user_turn(self, conversation: _Conversation) -> None:
        """A user message, then replies (and tool rounds) until a reply is not a tool call."""
        config = self.config
        conversation.history.append(self.segment(config.user_tokens))
        while True:
            self.request(conversation)
            if self.rng.random() >= config.tool_share:
                break
            conversation.history.append(self.segment(config.tool_tokens))
            conversation.clock_ms += self.rng.expovariate(1.0 / config.tool_gap_s) * 1000.0
        conversation.turns_left -= 1
        conversation.clock_ms += self.gap(config.turn_gap_s) * 1000.0

    def request(self, conversation: _Conversation) -> tuple[int, int]:
        """Send the history; its reply joins the history once generated."""
        reply = self.segment(self.config.output_tokens)
        request = SynthRequest(
            round(conversation.clock_ms), list(conversation.history), reply, conversation.number
        )
        conversation.requests.append(request)
        conversation.history.append(reply)
        conversation.clock_ms += reply[1] * DECODE_MS_PER_TOKEN
        return reply


def _cumulative(weights: list[float]) -> Iterator[float]:
    total = 0.0
    for weight in weights:
        total += weight
        yield total


def synth_requests(config: SynthConfig) -> list[SynthRequest]:
    """Every request of the family, in timestamp order (ties: arrival order)."""
    streams = [c.requests for c in Generator(config).conversations()]
    return list(heapq.merge(*streams, key=lambda request: request.timestamp_ms))


class TokenSource:
    """The token ids of each segment, derived from the seed and the segment's number."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cache: dict[int, list[int]] = {}

    def tokens(self, segment: tuple[int, int]) -> list[int]:
        number, length = segment
        ids = self.cache.get(number)
        if ids is None:
            rng = random.Random(f"{self.seed}/{number}")
            ids = self.cache[number] = rng.choices(range(VOCAB), k=length)
        return ids


def to_token_requests(requests: list[SynthRequest], seed: int) -> list[TokenRequest]:
    """Our token-id format: the prompt and the reply's token ids."""
    source = TokenSource(seed)
    rows = []
    for request in requests:
        prompt = [token for segment in request.segments for token in source.tokens(segment)]
        output = list(source.tokens(request.output))
        rows.append(TokenRequest(request.timestamp_ms, prompt, output, session=_session(request)))
    return rows


def to_mooncake_requests(requests: list[SynthRequest]) -> list[MooncakeRequest]:
    """The Mooncake format: one prefix-chained id per 512-token block of the input."""
    ids: dict[tuple, int] = {}
    rows = []
    for request in requests:
        length = sum(tokens for _, tokens in request.segments)
        parent = -1
        chain = []
        for piece in _block_pieces(request.segments, MOONCAKE_BLOCK_TOKENS):
            parent = ids.setdefault((parent, piece), len(ids))
            chain.append(parent)
        rows.append(
            MooncakeRequest(
                request.timestamp_ms, length, request.output[1], chain, session=_session(request)
            )
        )
    return rows


def _session(request: SynthRequest) -> str:
    """The session a trace line carries: its conversation's number."""
    return str(request.conversation)


def _block_pieces(segments: list[tuple[int, int]], block_tokens: int) -> Iterator[tuple]:
    """Each block's content as (segment, start, end) pieces; the last block may be partial."""
    pieces: list[tuple[int, int, int]] = []
    room = block_tokens
    for number, length in segments:
        start = 0
        while start < length:
            end = min(length, start + room)
            pieces.append((number, start, end))
            room -= end - start
            start = end
            if not room:
                yield tuple(pieces)
                pieces, room = [], block_tokens
    if pieces:
        yield tuple(pieces)


def synth_trace(config: SynthConfig, trace_format: str = "mooncake", name: str = "") -> Trace:
    """A whole trace in memory, as ``load_trace`` would return it."""
    requests = synth_requests(config)
    if trace_format == "mooncake":
        rows: list = to_mooncake_requests(requests)
    elif trace_format == "tokens":
        rows = to_token_requests(requests, config.seed)
    else:
        raise ValueError(f"unknown trace format {trace_format!r}; choose mooncake or tokens")
    return Trace(name or f"<synth seed {config.seed}>", trace_format, rows)


def family_config(family: str, **overrides: object) -> SynthConfig:
    """A family's knobs with some replaced (None leaves a knob as the family sets it)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    changes = {name: value for name, value in overrides.items() if value is not None}
    return dataclasses.replace(FAMILIES[family], **changes)


def write_trace(trace: Trace, path: str | Path) -> int:
    """Write ``trace`` as JSON lines in its format; the number of lines."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in trace.requests:
            handle.write(json.dumps(_record(row), separators=(",", ":")) + "\n")
    return len(trace.requests)


def _record(row: MooncakeRequest | TokenRequest) -> dict:
    if isinstance(row, MooncakeRequest):
        return {
            "timestamp": row.timestamp,
            "input_length": row.input_length,
            "output_length": row.output_length,
            "hash_ids": row.hash_ids,
            "session": row.session,
        }
    return {
        "timestamp": row.timestamp,
        "token_ids": row.token_ids,
        "output_token_ids": row.output_token_ids,
        "session": row.session,
    }
