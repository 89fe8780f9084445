"""The learned policy's safety net: a sampled shadow LRU and the hits it would have had.

A sample of content (by digest, at least ``MIN_SHADOW`` blocks' worth) is replayed through
an LRU of the pool's size scaled to the sample. Each window of sampled references compares
the pool's own hits on them with the shadow's. While the policy trails LRU by more than
chance (two standard deviations), it runs as LRU for a spell that doubles with every
failed trial, so a policy that cannot help costs at most a shrinking share of LRU's hits.
"""

from __future__ import annotations

import math
from collections import OrderedDict


class LRUGuard:
    """A sampled shadow LRU, the window comparison, and whether to trust the model."""

    MIN_SHADOW = 512  # shadow entries at least (the whole pool below that size)
    WINDOW = 2048  # sampled references per comparison
    MAX_SPELL = 64  # windows of LRU after repeated failures, at most

    def __init__(self, num_blocks: int) -> None:
        rate = min(1.0, max(1 / 16, self.MIN_SHADOW / max(1, num_blocks)))
        self.threshold = math.ceil(256 * rate)  # digests whose first byte is below: sampled
        self.capacity = max(1, round(num_blocks * self.threshold / 256))
        self.shadow: OrderedDict[bytes, None] = OrderedDict()
        self.references = self.hits = self.shadow_hits = 0
        self.trusted = True
        self.spell = 1  # windows of LRU the next failure costs
        self.lru_windows_left = 0
        self.trials = self.failures = 0

    def sampled(self, digest: bytes | None) -> bool:
        return digest is not None and digest[0] < self.threshold

    def reference(self, digest: bytes, hit: bool) -> None:
        """A sampled block was referenced: a hit in the pool or not."""
        shadow = self.shadow
        if digest in shadow:
            shadow.move_to_end(digest)
            self.shadow_hits += 1
        else:
            shadow[digest] = None
            if len(shadow) > self.capacity:
                shadow.popitem(last=False)
        self.hits += hit
        self.references += 1
        if self.references >= self.WINDOW:
            self._judge()

    def _judge(self) -> None:
        """End a window: keep trusting the model, or fall back to LRU for a spell."""
        if self.trusted:
            self.trials += 1
            noise = 2.0 * math.sqrt(max(1, self.shadow_hits))
            if self.hits < self.shadow_hits - noise:
                self.failures += 1
                self.trusted = False
                self.lru_windows_left = self.spell
                self.spell = min(self.MAX_SPELL, 2 * self.spell)
            else:
                self.spell = max(1, self.spell // 2)
        else:
            self.lru_windows_left -= 1
            self.trusted = self.lru_windows_left <= 0
        self.references = self.hits = self.shadow_hits = 0
