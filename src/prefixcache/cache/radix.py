"""A radix-tree prefix index (SGLang's RadixAttention layout) behind the hash index's interface.

Nodes hold runs of blocks, each block the child of the one before it; a node's children are
keyed by the label (token bytes[, extras]) of their first block. Inserting below the middle
of a run splits it; a lookup is a longest-prefix match that compares token bytes along runs
and does one dict lookup per node boundary.

Keys are the hash index's own chain keys, ``(parent uid, token bytes[, extras])``, so the
two indexes always agree. Removing a block from the middle of the tree (an eviction that is
not a leaf) cuts off what hangs below it: that part stays indexed but unreachable, in a
*detached* run, exactly as orphaned keys stay in the dict until their blocks are reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefixcache.cache.common import DEFAULT_BLOCK_SIZE, TOKEN_BYTES, require
from prefixcache.cache.hashing import ROOT_UID
from prefixcache.cache.index import PrefixMatch

if TYPE_CHECKING:
    from prefixcache.cache.blocks import Block


NO_MISS: tuple = ((), None, 0)


class RadixNode:
    """A run of blocks, each the child of the one before, and the runs hanging below it."""

    __slots__ = ("blocks", "children", "parent")

    def __init__(self, blocks: list[Block], parent: RadixNode | None) -> None:
        self.blocks = blocks
        self.children: dict[tuple, RadixNode] = {}  # first block's label -> child
        self.parent = parent  # None for the root and for detached runs

    def __repr__(self) -> str:
        return f"RadixNode({[block.block_id for block in self.blocks]})"


class RadixIndex:
    """Chain key -> block, stored as a radix tree of block runs (see the module docstring)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.clear()

    def clear(self) -> None:
        """Forget every block."""
        self.root = RadixNode([], None)
        self._where: dict[int, tuple[RadixNode, int]] = {}  # uid -> (node, offset in run)
        self._detached: dict[tuple, RadixNode] = {}  # first block's key -> unreachable run
        self._last_miss: tuple = NO_MISS  # (key, node, offset) of the last get(), if current

    # ------------------------------------------------------------------ lookup
    def walk(
        self,
        token_bytes: bytes,
        max_blocks: int,
        extras: dict,
        start: int = 0,
        parent_uid: int = ROOT_UID,
    ) -> PrefixMatch:
        """Longest-prefix match of blocks ``start``.. below ``parent_uid`` (rule 4)."""
        step = self.block_size * TOKEN_BYTES
        hits: list[Block] = []
        uids: list[int] = []
        index = start
        node, pos = self._where[parent_uid] if start else (self.root, -1)
        run, pos = node.blocks, pos + 1
        while index < max_blocks:
            chunk = token_bytes[index * step : (index + 1) * step]
            extra = extras.get(index) if extras else None
            if pos < len(run):
                block = run[pos]
                key = block.key
                if key[1] != chunk or (key[2] if len(key) > 2 else None) != extra:
                    break
            else:
                node = node.children.get((chunk, extra) if extra else (chunk,))
                if node is None:
                    break
                run, pos = node.blocks, 0
                block = run[0]
            pos += 1
            index += 1
            hits.append(block)
            uids.append(block.uid)
        return PrefixMatch(hits, uids)

    def replace(self, heir: Block) -> None:
        """Put ``heir`` where the indexed copy of its uid sits: runs below stay attached.

        Not a delete and re-insert, which would detach every run below the key.
        """
        node, offset = self._where[heir.uid]
        node.blocks[offset] = heir

    def get(self, key: tuple, default: None = None) -> Block | None:
        """The indexed block holding ``key``, or ``default``."""
        parent = key[0]
        where = self._where.get(parent) if parent != ROOT_UID else (self.root, -1)
        if where is None:
            self._last_miss = (key, None, 0)
            detached = self._detached.get(key)
            return detached.blocks[0] if detached is not None else default
        node, pos = where[0], where[1] + 1
        self._last_miss = (key, node, pos)  # store() asks get() first, then inserts here
        blocks = node.blocks
        if pos < len(blocks):
            block = blocks[pos]
            return block if block.key == key else default
        child = node.children.get(key[1:])
        return child.blocks[0] if child is not None else default

    def _slot_below(self, parent_uid: int) -> tuple[RadixNode | None, int]:
        """(node, offset) where a child of ``parent_uid`` sits in a run; None if not indexed."""
        if parent_uid == ROOT_UID:
            return self.root, 0
        where = self._where.get(parent_uid)
        if where is None:
            return None, 0
        return where[0], where[1] + 1

    # ------------------------------------------------------- insert and remove
    def __setitem__(self, key: tuple, block: Block) -> None:
        """Index ``block`` (uid already set) under ``key``, which must not be present."""
        last_key, node, pos = self._last_miss
        self._last_miss = NO_MISS
        if last_key is not key:
            node, pos = self._slot_below(key[0])
        if node is None:  # its parent is no longer indexed: unreachable from the start
            self._detach(RadixNode([block], None))
            return
        if pos < len(node.blocks):
            self._split(node, pos)
        if node.children or node is self.root:
            child = RadixNode([block], node)
            node.children[key[1:]] = child
            self._where[block.uid] = (child, 0)
        else:  # the common case: extend a leaf's run
            self._where[block.uid] = (node, len(node.blocks))
            node.blocks.append(block)

    def __delitem__(self, key: tuple) -> None:
        """Remove the block holding ``key``; whatever hangs below it becomes unreachable."""
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        self._last_miss = NO_MISS
        node, offset = self._where.pop(block.uid)
        blocks = node.blocks
        if offset == len(blocks) - 1 and not node.children:  # a leaf: the usual victim
            blocks.pop()
        else:
            self._cut(node, offset)
        if not blocks:
            self._unlink(node, key)

    def _cut(self, node: RadixNode, offset: int) -> None:
        """Remove the block at ``offset``; the run below it and its children are detached."""
        below = node.blocks[offset + 1 :]
        del node.blocks[offset:]
        if below:
            run = RadixNode(below, None)
            run.children = node.children
            self._detach(run)
        else:
            for child in node.children.values():
                self._detach(child)
        node.children = {}

    def _split(self, node: RadixNode, pos: int) -> None:
        """Cut ``node``'s run before ``pos``; the tail becomes its only child."""
        tail = RadixNode(node.blocks[pos:], node)
        tail.children = node.children
        del node.blocks[pos:]
        node.children = {tail.blocks[0].key[1:]: tail}
        self._adopt(tail)

    def _detach(self, run: RadixNode) -> None:
        """File ``run`` as unreachable, under its first block's key."""
        run.parent = None
        self._detached[run.blocks[0].key] = run
        self._adopt(run)

    def _adopt(self, node: RadixNode) -> None:
        """Point the location map and the children's parent links at ``node``."""
        where = self._where
        for offset, block in enumerate(node.blocks):
            where[block.uid] = (node, offset)
        for child in node.children.values():
            child.parent = node

    def _unlink(self, node: RadixNode, first_key: tuple) -> None:
        """Drop an emptied node from its parent (or from the detached runs)."""
        if node.parent is not None:
            del node.parent.children[first_key[1:]]
        else:
            del self._detached[first_key]

    # ------------------------------------------------------------ dict-likes
    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.get(key) is not None

    def __getitem__(self, key: tuple) -> Block:
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        return block

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[tuple]:
        return (key for key, _ in self.items())

    def keys(self) -> Iterator[tuple]:
        return iter(self)

    def items(self) -> Iterator[tuple[tuple, Block]]:
        """(key, block) for every indexed block, reachable or not."""
        for node, offset in list(self._where.values()):
            block = node.blocks[offset]
            yield block.key, block

    def values(self) -> Iterator[Block]:
        return (block for _, block in self.items())

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every run chains parent to child, the location map is exact, detached runs are."""
        starts = [(self.root, ROOT_UID)]
        for key, run in self._detached.items():
            require(run.parent is None and run.blocks, f"radix: detached {run} is malformed")
            require(run.blocks[0].key == key, f"radix: detached {run} filed under a wrong key")
            require(key[0] not in self._where, f"radix: detached {run} is reachable")
            starts.append((run, key[0]))
        seen = sum(self._check_subtree(node, parent) for node, parent in starts)
        require(seen == len(self._where), f"radix: {len(self._where)} located, {seen} in runs")

    def _check_subtree(self, top: RadixNode, parent_uid: int) -> int:
        """Blocks under ``top`` (checked); iterative, since runs can nest deeply."""
        count, stack = 0, [(top, parent_uid)]
        while stack:
            node, parent = stack.pop()
            require(node is self.root or node.blocks, f"radix: empty node {node}")
            for offset, block in enumerate(node.blocks):
                key = block.key
                require(key is not None and key[0] == parent, f"radix: {block} breaks its run")
                require(self._where.get(block.uid) == (node, offset), f"radix: {block} mislocated")
                parent = block.uid
                count += 1
            for label, child in node.children.items():
                require(child.parent is node, f"radix: {child} has a stale parent link")
                require(child.blocks[0].key[1:] == label, f"radix: {child} filed under bad label")
                stack.append((child, parent))
        return count
