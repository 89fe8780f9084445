"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_N = 16  # completions per request
MAX_TEMPERATURE = 2.0  # OpenAI's range; hotter is noise
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` is greedy.

    The limits above are the only ones: the server's request schemas read them.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field outside its range."""
        checks = [
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0.0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0: no limit), got {self.top_k}"),
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
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int) -> torch.Generator:
    """A private random stream, so one request's draws never depend on another's."""
    return torch.Generator().manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """One token per row of ``logits`` ([N, vocab]), each row with its own params."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, (param, generator) in enumerate(zip(params, generators, strict=True)):
        if param.greedy:
            tokens.append(greedy_ids[row])
        else:
            tokens.append(_sample_row(logits[row], param, generator))
    return tokens


def _sample_row(logits: torch.Tensor, param: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p, then one draw from this row's generator."""
    scores = logits.float() / param.temperature
    if param.top_k and param.top_k < scores.numel():
        kth = torch.topk(scores, param.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if param.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= param.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
