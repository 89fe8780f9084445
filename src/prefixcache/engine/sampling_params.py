"""Sampling parameters: how to pick tokens and when to stop, checked at construction.

Torch-free, so that the server's preparation processes (server/prepare_pool.py), which
build these from request bodies, start without importing torch (engine/sampling.py samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.protocol.constraints import Constraint, JsonOutput, ToolCalls
from prefixcache.protocol.sampling_limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` is greedy.

    Its ranges live in ``protocol/sampling_limits.py``, read by the request schemas too.
    ``logprobs``/``prompt_logprobs``: None for none, k >= 0 for the chosen token plus k top.
    """

    n: int = 1
    max_tokens: int = 16  # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop token, EOS or stop string before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None  # the output must match it (engine/grammar.py)

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field outside its range."""
        for ok, message in self._checks() + self._processor_checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (
                self.max_tokens >= (0 if self.prompt_logprobs is not None else 1),
                f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}",
            ),
            (
                self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE}], "
                f"got {self.temperature}",
            ),
            (
                MIN_TOP_P <= self.top_p <= 1.0,
                f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}",
            ),
            (self.top_k >= 0, f"top_k must be >= 0 (0: no limit), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.seed is None or 0 <= self.seed <= MAX_SEED,
                f"seed must be in [0, {MAX_SEED}], got {self.seed}",
            ),
            (
                len(self.stop) <= MAX_STOP_STRINGS
                and all(isinstance(s, str) and s for s in self.stop),
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative ints",
            ),
            (
                self.constraint is None or isinstance(self.constraint, JsonOutput | ToolCalls),
                "constraint must be a JsonOutput, a ToolCalls or None",
            ),
        ]

    def _processor_checks(self) -> list[tuple[bool, str]]:
        """Penalties, bias, min_tokens and logprobs."""
        bias_ok = all(
            isinstance(t, int) and t >= 0 and abs(b) <= MAX_LOGIT_BIAS
            for t, b in self.logit_bias.items()
        )
        return [
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                abs(self.presence_penalty) <= MAX_PENALTY,
                f"presence_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], "
                f"got {self.presence_penalty}",
            ),
            (
                abs(self.frequency_penalty) <= MAX_PENALTY,
                f"frequency_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], "
                f"got {self.frequency_penalty}",
            ),
            (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS and bias_ok,
                f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to values "
                f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                all(k is None or 0 <= k <= MAX_LOGPROBS for k in self._logprob_counts),
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
        ]

    @property
    def _logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.prompt_logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any processor changes this request's logits before sampling."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def fold_seed(seed: int) -> int:
    """A client's int64/uint64 seed as one of ours, [0, MAX_SEED] (distinct seeds mod 2**63)."""
    return seed % (MAX_SEED + 1)
