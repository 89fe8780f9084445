"""The leaf of the cache: physical block records, the intrusive free queue and its check.

Everything else in the package (policies, pool, index) builds on these; this module imports
nothing of the package but ``common``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prefixcache.cache.common import require


class Block:
    """One physical KV block: id, refcount, identity once full, free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "key", "uid", "digest", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: tuple | None = None  # set only while this block is the indexed copy
        self.uid = 0  # content id of a full, committed block (0: none)
        self.digest: bytes | None = None  # portable chained digest of that content
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, uid={self.uid})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop, push and unlink.

    The head is the next eviction victim; the tail the most recently freed block.
    """

    __slots__ = ("head", "tail", "size")

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels: no None checks on the hot path
        self.tail = Block(-2)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        """Remove and return the head (the least recently freed block)."""
        block = self.head.next_free
        assert block is not self.tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def append(self, block: Block) -> None:
        """Put ``block`` at the tail: evicted last."""
        last = self.tail.prev_free
        block.prev_free, block.next_free = last, self.tail
        last.next_free = block
        self.tail.prev_free = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        """Put ``block`` at the head: reused first (it holds nothing worth keeping)."""
        first = self.head.next_free
        block.prev_free, block.next_free = self.head, first
        first.prev_free = block
        self.head.next_free = block
        self.size += 1

    def __iter__(self) -> Iterator[Block]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.size


def check_queue(queue: FreeBlockQueue, what: str) -> set[int]:
    """A queue's links are consistent and it holds only refcount-0 blocks, once each."""
    seen: set[int] = set()
    previous = queue.head
    block = queue.head.next_free
    while block is not queue.tail:
        require(block is not None, f"{what}: broken forward link")
        require(block.prev_free is previous, f"{what}: bad back link at {block}")
        require(block.block_id not in seen, f"{what}: {block} appears twice")
        require(block.ref_cnt == 0, f"rule 6: {block} is in the {what} while in use")
        seen.add(block.block_id)
        previous, block = block, block.next_free
    require(queue.tail.prev_free is previous, f"{what}: tail back link is stale")
    require(len(seen) == queue.size, f"{what}: size {queue.size} != {len(seen)} linked")
    return seen
