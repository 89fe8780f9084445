"""A request's view of the cache: its tokens, its block table and its chain."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from prefixcache.cache.block_pool import Block
from prefixcache.cache.hashing import Extras, MultiModalItem, block_digest, encode_tokens

BLOCK_ID = attrgetter("block_id")


class Sequence:
    """The blocks one request holds, and how many of its tokens are cached and computed."""

    __slots__ = (
        "request_id",
        "block_size",
        "token_ids",
        "blocks",
        "block_table",
        "num_cached_tokens",
        "num_computed_tokens",
        "cache_salt",
        "lora_name",
        "mm_items",
        "extras",
        "num_stored_blocks",
        "num_prompt_tokens",
        "cap_last_token",
        "_prompt_bytes",
        "_hash_fn",
        "_root_digest",
    )

    def __init__(
        self,
        request_id: str,
        block_size: int,
        token_ids: list[int],
        prompt_bytes: bytes,
        blocks: list[Block],
        extras: dict[int, Extras],
        hash_fn: Callable[[bytes], bytes],
        root_digest: bytes,
    ) -> None:
        self.request_id = request_id
        self.block_size = block_size
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.blocks = blocks
        self.block_table = list(map(BLOCK_ID, blocks))
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.cache_salt: str | None = None
        self.lora_name: str | None = None
        self.mm_items: tuple[MultiModalItem, ...] = ()
        self.extras = extras  # block index -> typed extra keys, only where non-empty
        self.num_stored_blocks = 0  # leading full blocks that hold an identity
        self.cap_last_token = True  # rule 10 applied at admission (trace replay may lift it)
        self._prompt_bytes = prompt_bytes
        self._hash_fn = hash_fn
        self._root_digest = root_digest

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={len(self.token_ids)}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )

    def clone(self, request_id: str) -> Sequence:
        """A copy sharing the same blocks (the caller takes the extra references)."""
        child = Sequence(
            request_id,
            self.block_size,
            list(self.token_ids),
            self._prompt_bytes,
            list(self.blocks),
            self.extras,
            self._hash_fn,
            self._root_digest,
        )
        child.cache_salt, child.lora_name = self.cache_salt, self.lora_name
        child.mm_items = self.mm_items
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_stored_blocks = self.num_stored_blocks
        child.cap_last_token = self.cap_last_token
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_bytes(self, index: int) -> bytes:
        """Token bytes of full block ``index``, sliced from the prompt where possible."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        if end * 4 <= len(self._prompt_bytes):
            return self._prompt_bytes[start * 4 : end * 4]
        return encode_tokens(self.token_ids[start:end])

    def parent_digest(self, index: int) -> bytes:
        """Digest the chain of block ``index`` hangs from (a held block keeps its digest)."""
        return self.blocks[index - 1].digest if index else self._root_digest

    @property
    def block_hashes(self) -> list[str]:
        """Portable hex digests of every full block (computed now for uncommitted ones)."""
        return [digest.hex() for digest in self.full_block_digests()]

    def full_block_digests(self) -> list[bytes]:
        """Stored digests, extended over full blocks not yet committed."""
        digests = [block.digest for block in self.blocks[: self.num_stored_blocks]]
        for index in range(len(digests), len(self.token_ids) // self.block_size):
            parent = digests[index - 1] if index else self._root_digest
            chunk = self.block_bytes(index)
            extras = self.extras.get(index, ())
            digests.append(block_digest(parent, chunk, extras, self._hash_fn))
        return digests
