"""The learned policy's model: per class of signals, when released blocks are reused.

For each class it counts releases and first reuses by age (releases since the block's
own release, in powers of two; a reuse after eviction is known from the digest history).
From those counts it predicts, for a free block of a class and age, the chance it is
referenced within the next ``window`` releases, given it has not been yet. A class with
little evidence is pulled toward the pooled curve, which is made non-increasing in age,
so with no evidence at all every class ranks by age alone: LRU. Memory is fixed (classes
times ``BINS`` floats); counts halve every few pools' worth of releases.
"""

from __future__ import annotations

BINS = 40  # age bins: 0, 1, 2-3, 4-7, ... (an age's bit length)
LAST_BIN = BINS - 1


def age_bin(age: int) -> int:
    """The bin of an age in releases."""
    bits = age.bit_length()
    return bits if bits < LAST_BIN else LAST_BIN


class ReuseModel:
    """Release and first-reuse counts by class and age bin, and the predictions they give."""

    EVIDENCE = 64.0  # exposures at an age before a class's own curve counts as much as the pool's
    WINDOW_POOLS = 4.0  # the prediction's horizon, in pools' worth of releases
    HALF_LIFE_POOLS = 4
    MIN_HALF_LIFE = 16384  # releases

    def __init__(self, num_blocks: int, classes: int) -> None:
        self.classes = classes
        self.window = max(1, int(self.WINDOW_POOLS * num_blocks))
        self.released = [0.0] * classes
        self.reused = [[0.0] * BINS for _ in range(classes)]
        self.half_life = max(self.HALF_LIFE_POOLS * num_blocks, self.MIN_HALF_LIFE)
        self.until_decay = self.half_life
        self.until_refresh = self.refresh_every = max(2048, num_blocks)
        self.prediction = [[1.0] * BINS for _ in range(classes)]  # no evidence: all alike

    def note_releases(self, classes: list[int]) -> None:
        """Blocks of these classes were released; re-predict and decay on schedule."""
        released = self.released
        for cls in classes:
            released[cls] += 1.0
        self.until_refresh -= len(classes)
        if self.until_refresh <= 0:
            self.until_refresh = self.refresh_every
            self.refresh()

    def note_reuse(self, cls: int, age: int) -> None:
        """A block released as ``cls`` was referenced again ``age`` releases later."""
        self.reused[cls][age_bin(age)] += 1.0

    def refresh(self) -> None:
        """Recompute every prediction from the counts; halve the counts once per half-life."""
        pool_curve = self.pooled_curve()
        evidence = self.EVIDENCE
        for cls in range(self.classes):
            own, exposed = self._curve(self.reused[cls], self.released[cls])
            self.prediction[cls] = [
                (exposed[b] * own[b] + evidence * pool_curve[b]) / (exposed[b] + evidence)
                for b in range(BINS)
            ]
        self.until_decay -= self.refresh_every
        if self.until_decay <= 0:
            self.until_decay = self.half_life
            self.released = [count / 2 for count in self.released]
            self.reused = [[count / 2 for count in counts] for counts in self.reused]

    def pooled_curve(self) -> list[float]:
        """Every class's counts together, made non-increasing in age: the fallback curve."""
        pooled = [sum(counts[b] for counts in self.reused) for b in range(BINS)]
        curve, _ = self._curve(pooled, sum(self.released))
        for b in range(1, BINS):  # never more likely to be reused for being older
            curve[b] = min(curve[b], curve[b - 1])
        return curve

    def _curve(self, reused: list[float], released: float) -> tuple[list[float], list[float]]:
        """Per bin: P(reused within the window | not yet at the bin's youngest age), and the
        number of releases that reached that age unreused (the evidence behind it)."""
        before = [0.0] * (BINS + 1)
        for b in range(BINS):
            before[b + 1] = before[b] + reused[b]
        chances, exposed = [0.0] * BINS, [0.0] * BINS
        for b in range(BINS):
            youngest = 1 << (b - 1) if b else 0
            end = age_bin(youngest + self.window)
            exposed[b] = max(0.0, released - before[b])
            if exposed[b] > 0:
                chances[b] = (before[end + 1] - before[b]) / exposed[b]
        return chances, exposed
