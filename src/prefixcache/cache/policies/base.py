"""The interface every eviction policy implements, and where a free block is held."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prefixcache.cache.blocks import Block

ALL_SIGNALS = frozenset({"seen", "last", "depth"})  # every class feature (plus leaf-first)
DEFAULT_SIGNALS = frozenset({"seen", "last"})  # depth splits classes without paying (README)

NOWHERE, DOOMED, PROBATION, PROTECTED = -1, 0, 1, 2  # where a free block is held
FROM_DOOMED, FROM_PROBATION, FROM_PROTECTED = 0, 1, 2  # the ghost list an eviction joins


class EvictionPolicy:
    """Orders the free cached blocks of one pool (see the module docstring for the events)."""

    name = ""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def touch(self, blocks: list[Block]) -> None:
        raise NotImplementedError

    def insert(self, blocks: list[Block]) -> None:
        raise NotImplementedError

    def pop_victim(self) -> Block:
        raise NotImplementedError

    def clear(self) -> list[Block]:
        raise NotImplementedError

    def acquire(self, blocks: list[Block]) -> None:
        """A reference on each block (hits, a fork): ``touch``, then the refcounts rise.

        One pass in ``LRUPolicy``: this is the hot path of every hit."""
        self.touch(blocks)
        for block in blocks:
            block.ref_cnt += 1

    def release_refs(self, blocks: Iterable[Block]) -> list[Block]:
        """Drop a reference on each; cached ones reaching 0 are ``insert``ed in the order
        given; returns those reaching 0 that hold nothing (for the pool's empty queue)."""
        cached, empties = [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (empties if block.key is None else cached).append(block)
        if cached:
            self.insert(cached)
        return empties

    def fresh(self) -> EvictionPolicy:
        """An empty policy of the same kind and size: another owner's part of a fair pool."""
        return type(self)(self.num_blocks)

    def disown(self, block: Block) -> None:
        """A live block last seen here is released to another policy (another owner's in a
        fair pool): forget what was learned about it, so none of it leaks to later content."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Block]:
        raise NotImplementedError

    def check(self) -> None:
        """AssertionError if the policy's own structures are inconsistent."""
