"""The prefix index: which indexed block holds a chain key, and the lookup walk over it.

Two implementations share one small interface (``PrefixIndex``): the hash-chain dict (the
default, the article's design) and a radix tree (``radix.py``, SGLang's design). Both are
keyed by the same exact chain key, ``(parent uid, token bytes[, extras])``, so for any
workload they match exactly the same blocks; only the data structure differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, TOKEN_BYTES
from prefixcache.cache.hashing import ROOT_UID

if TYPE_CHECKING:
    from prefixcache.cache.blocks import Block

INDEX_NAMES = ("hash", "radix")
DEFAULT_INDEX = "hash"


class PrefixMatch(NamedTuple):
    """Blocks found by one walk, and their content ids, in chain order."""

    blocks: list[Block]
    uids: list[int]


class PrefixIndex(Protocol):
    """What the pool and the manager need from an index (a subset of a dict, plus ``walk``)."""

    block_size: int
    # walk(token_bytes, max_blocks, extras, start=0, parent_uid=ROOT_UID): blocks ``start``..
    # below ``parent_uid`` (the last block already matched), up to the first miss (rule 4)
    walk: Callable[..., PrefixMatch]

    def get(self, key: tuple, default: None = None) -> Block | None:
        """The indexed block holding ``key``, or None."""

    def replace(self, heir: Block) -> None:
        """Make ``heir`` (same key and uid as the indexed copy) the indexed copy, in place."""

    def __setitem__(self, key: tuple, block: Block) -> None:
        """Index ``block`` (whose uid is already set) under a key not yet present."""

    def __delitem__(self, key: tuple) -> None:
        """Forget ``key`` (eviction)."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def items(self) -> Iterable[tuple[tuple, Block]]: ...

    def clear(self) -> None: ...

    def check(self) -> None:
        """AssertionError if the structure is inconsistent (beyond the pool-level checks)."""


class HashIndex(dict):
    """The hash-chain index: a plain dict from chain key to block, plus the lookup walk.

    Being the dict itself keeps every store, eviction and lookup a C-level dict operation.
    """

    __slots__ = ("block_size",)

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__()
        self.block_size = block_size

    def walk(
        self,
        token_bytes: bytes,
        max_blocks: int,
        extras: dict,
        start: int = 0,
        parent_uid: int = ROOT_UID,
    ) -> PrefixMatch:
        """Blocks ``start``.. found through the dict, under ``parent_uid``; stop at the first miss.

        Rule 4; ``max_blocks`` carries rule 10's cap.
        """
        step = self.block_size * TOKEN_BYTES
        get = self.get
        hits: list[Block] = []
        uids: list[int] = []
        parent = parent_uid
        for index in range(start, max_blocks):
            chunk = token_bytes[index * step : (index + 1) * step]
            extra = extras.get(index) if extras else None
            block = get((parent, chunk, extra) if extra else (parent, chunk))
            if block is None:
                break
            parent = block.uid
            hits.append(block)
            uids.append(parent)
        return PrefixMatch(hits, uids)

    def replace(self, heir: Block) -> None:
        """Make ``heir`` (same key and uid as the indexed copy) the indexed copy."""
        self[heir.key] = heir

    def check(self) -> None:
        """A dict has no structure beyond what the pool-level checks already verify."""


def make_index(name: str, block_size: int) -> PrefixIndex:
    """The index called ``name``; ValueError lists the choices."""
    if name == "hash":
        return HashIndex(block_size)
    if name == "radix":
        from prefixcache.cache.radix import RadixIndex

        return RadixIndex(block_size)
    raise ValueError(f"unknown index {name!r}; choose one of {list(INDEX_NAMES)}")
