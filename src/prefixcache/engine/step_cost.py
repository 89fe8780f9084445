"""An online model of a step's time: seconds = a + b·prefill + c·attention + d·decode rows.

``attention`` is the sum over chunks of tokens x context they attend to (n·(start + n/2)),
so a chunk deep in a long prompt costs more than one at its start. The coefficients start
from a prior measured on a 2-core AVX-512 CPU (SmolLM2-135M, int4) and follow measured
steps by exponentially weighted least squares pulled toward that prior (ridge), so a few
odd steps cannot make a coefficient negative or wild. Pure arithmetic: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import numpy as np

# Prior (seconds): ~10 ms per step, ~1.1 ms per prefill token (~900 tok/s for a 2,000-token
# prompt), 1e-7 per token·context, ~5 ms per decode row (32 streams at ~200 tok/s).
PRIOR = (0.010, 1.1e-3, 1.0e-7, 5.0e-3)
# Feature scales, so the normal equations are well conditioned.
_SCALE = np.array([1.0, 1e3, 1e6, 10.0])


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes: prefill tokens, token·context products, decode rows."""

    prefill_tokens: int = 0
    attention: float = 0.0
    decode_rows: int = 0

    def with_prefill(self, start: int, num_tokens: int) -> StepShape:
        """This step plus a prefill chunk of ``num_tokens`` after ``start`` computed ones."""
        attention = self.attention + chunk_attention(start, num_tokens)
        return StepShape(self.prefill_tokens + num_tokens, attention, self.decode_rows)

    def features(self) -> np.ndarray:
        return np.array(self.scaled())

    def scaled(self) -> tuple[float, float, float, float]:
        """The features divided by their scales (`_SCALE`), as plain floats."""
        raw = (1.0, self.prefill_tokens, self.attention, self.decode_rows)
        a, b, c, d = (float(value) / float(scale) for value, scale in zip(raw, _SCALE, strict=True))
        return a, b, c, d


def chunk_attention(start: int, num_tokens: int) -> float:
    """Token·context work of ``num_tokens`` new tokens after ``start`` computed ones."""
    return num_tokens * (start + num_tokens / 2)


@dataclass(slots=True)
class StepCost:
    """Predicts a step's seconds from its shape; ``observe`` refits on a measured step."""

    prior: tuple[float, float, float, float] = PRIOR
    decay: float = 0.98  # per observed step: ~50 steps of memory
    prior_weight: float = 4.0  # the prior counts as this many steps
    learn: bool = True  # False: the prior only (tests' fixed cost)
    num_observed: int = 0
    # The weighted normal equations, as plain floats (row-major 4x4, and 4): folding a step in
    # is 20 multiply-adds, cheaper than numpy's calls on arrays this small.
    _gram: list[float] = field(default_factory=lambda: [0.0] * 16)
    _moment: list[float] = field(default_factory=lambda: [0.0] * 4)
    _theta: np.ndarray = field(init=False)
    _stale: bool = False  # steps observed since the last solve (solved when next used)

    def __post_init__(self) -> None:
        self._theta = np.array(self.prior) * _SCALE

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a, b, c, d) in seconds per unit of each term."""
        return tuple(float(x) for x in self._fitted() / _SCALE)

    def predict(self, shape: StepShape) -> float:
        """Seconds the step is expected to take."""
        return float(shape.features() @ self._fitted())

    def tokens_fitting(self, shape: StepShape, start: int, limit: int, target: float) -> int:
        """How many of ``limit`` more prefill tokens, after ``start`` computed ones, keep a
        step of ``shape`` within ``target`` seconds (0 if it is already over)."""
        _, b, c, _ = self.coefficients
        left = target - self.predict(shape)
        if left <= 0:
            return 0
        linear = b + c * start  # n more tokens cost linear * n + c / 2 * n^2
        if c > 0:
            n = (-linear + (linear * linear + 2 * c * left) ** 0.5) / c
        else:
            n = left / linear if linear > 0 else limit
        return max(0, min(limit, int(n)))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold a measured step into the fit (exponentially weighted, ridge to the prior)."""
        if not self.learn or seconds <= 0:
            return
        x, decay = shape.scaled(), self.decay
        self._gram = [
            decay * g + a * b for g, (a, b) in zip(self._gram, product(x, x), strict=True)
        ]
        self._moment = [decay * m + a * seconds for m, a in zip(self._moment, x, strict=True)]
        self.num_observed += 1
        self._stale = True

    def _fitted(self) -> np.ndarray:
        """The scaled coefficients, solved again only when a step was observed since: a
        lone decode observes every step and predicts none (the solve took ~100 us a step)."""
        if self._stale:
            ridge = self.prior_weight * np.eye(4)
            prior = np.array(self.prior) * _SCALE
            gram, moment = np.array(self._gram).reshape(4, 4), np.array(self._moment)
            solved = np.linalg.solve(gram + ridge, moment + ridge @ prior)
            self._theta = np.maximum(solved, 0.0)
            self._stale = False
        return self._theta


STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class StepTimes:
    """Measured step seconds as a cumulative histogram (published for Prometheus)."""

    buckets: tuple[float, ...] = STEP_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        index = next((i for i, edge in enumerate(self.buckets) if seconds <= edge), -1)
        self.counts[index] += 1
        self.total += seconds

    def cumulative(self) -> tuple[tuple[str, int], ...]:
        """``(le, count)`` pairs, the last ``+Inf``: Prometheus's histogram buckets."""
        edges = [f"{edge:g}" for edge in self.buckets] + ["+Inf"]
        running, rows = 0, []
        for edge, count in zip(edges, self.counts, strict=True):
            running += count
            rows.append((edge, running))
        return tuple(rows)
