"""Pluggable eviction policies: which free block that still holds cached content goes first.

The pool (``BlockPool``) holds one policy object (one per owner in a tenant-fair pool,
``OwnerParts``): LRU, the article's free queue and the default (``LRUPolicy``), or another.
The pool reuses blocks holding nothing first and asks the policy for a victim only when it
must evict. A policy sees four events:

- ``touch(blocks)``: a request references these blocks (cache hits, or a fork), before
  their refcounts rise; the free ones (refcount 0) must leave the policy's structures;
- ``insert(blocks)``: these cached blocks' refcounts dropped to 0, in release order
  (deepest block of a request first, so ties evict descendants before their ancestors);
- ``pop_victim()``: remove and return the block to reuse now;
- ``clear()``: ``reset``; returns every block it held.

Both take a whole request's blocks at once: one call per admission or free, not per
block. Policies that learn from history remember evicted content by its portable digest,
which is the same every time the same content is recomputed (uids are not).

Every policy here uses the same signals, derived from those events alone:

- **seen before**: the block was hit since its last release, or its digest is still in a
  bounded history of evicted content (four pools' worth);
- **last block**: the first block of an ``insert`` (the deepest one its request released);
- **depth** (optional, off by default: it did not pay): its position in the chain
  (``key[0]`` is the parent's uid, ``ROOT_UID`` at the root);
- **parent liveness**: a block whose parent is evicted can never hit again, so victims are
  always leaves (``ChainIndex``): the blocks below a victim go first, no block is orphaned.

``ReuseClasses`` learns, per class of those signals, how often a released block is
referenced again (hits, plus recomputations the history remembers). A class of last blocks
reused far less than the rest is *doomed*: evicted before anything else, until the history
proves it wrong. ARC, SLRU and LFU-DA size their protected part with ARC's ghost lists,
starting from LRU; ``signals`` keeps one LRU list per class, each aging at its own pace.
"""

from __future__ import annotations

from prefixcache.cache.policies.base import (
    ALL_SIGNALS,
    DEFAULT_SIGNALS,
    DOOMED,
    EvictionPolicy,
)
from prefixcache.cache.policies.learned import LearnedPolicy
from prefixcache.cache.policies.lfuda import LFUDAPolicy
from prefixcache.cache.policies.lru import LRUPolicy
from prefixcache.cache.policies.per_class import SignalsPolicy
from prefixcache.cache.policies.signal_policy import SignalPolicy
from prefixcache.cache.policies.signals import ChainDepths, ChainIndex, Ghosts, ReuseClasses
from prefixcache.cache.policies.split import ARCPolicy, LRUProtected, SLRUPolicy, SplitPolicy

POLICY_NAMES = ("lru", "arc", "slru", "lfuda", "signals", "learned")
DEFAULT_POLICY = "lru"  # the article's policy: the free queue

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "slru": SLRUPolicy,
    "lfuda": LFUDAPolicy,
    "signals": SignalsPolicy,
    "learned": LearnedPolicy,
}


def check_policy_name(name: str) -> None:
    """ValueError, listing the choices, unless ``name`` is a policy."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction_policy {name!r}; choose one of {list(POLICY_NAMES)}")


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """A new, empty policy called ``name`` over ``num_blocks`` block ids."""
    check_policy_name(name)
    return POLICIES[name](num_blocks)


__all__ = [
    "ALL_SIGNALS",
    "DEFAULT_POLICY",
    "DEFAULT_SIGNALS",
    "DOOMED",
    "POLICIES",
    "POLICY_NAMES",
    "ARCPolicy",
    "ChainDepths",
    "ChainIndex",
    "EvictionPolicy",
    "Ghosts",
    "LFUDAPolicy",
    "LRUPolicy",
    "LRUProtected",
    "LearnedPolicy",
    "ReuseClasses",
    "SLRUPolicy",
    "SignalPolicy",
    "SignalsPolicy",
    "SplitPolicy",
    "check_policy_name",
    "make_policy",
]
