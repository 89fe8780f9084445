"""A request's view of the cache: its tokens, its block table and its chain."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from operator import attrgetter

from prefixcache.cache.blocks import Block
from prefixcache.cache.common import TOKEN_BYTES
from prefixcache.cache.hashing import Extras, MultiModalItem, chain_digests, encode_tokens

BLOCK_ID = attrgetter("block_id")
NO_PAGE = -1  # a window table's entry for a block outside the window (never read)


@dataclass(frozen=True, slots=True)
class ChainKeys:
    """What besides token ids keys a request's blocks: fixed at admission, shared by forks."""

    prompt_bytes: bytes  # the prompt's token ids as uint32 bytes (blocks are sliced from it)
    extras: dict[int, Extras]  # block index -> typed extra keys, only where non-empty
    hash_fn: Callable[[bytes], bytes]
    root_digest: bytes
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    cap_last_token: bool = True  # rule 10 applied at admission (trace replay may lift it)


@dataclass(slots=True, eq=False)
class Sequence:
    """The blocks one request holds, and how many of its tokens are cached and computed."""

    request_id: str
    block_size: int
    token_ids: list[int]
    blocks: list[Block]
    keys: ChainKeys
    num_cached_blocks: InitVar[int] = 0  # leading blocks served from cache at admission
    owner: int = 0  # the owner id its freed blocks are charged to (a fair pool's)
    window_pages: list[list[Block | None]] = field(default_factory=list)  # per window group
    block_table: list[int] = field(init=False)
    window_tables: list[list[int]] = field(init=False)  # page ids per window group; -1: none
    window_from: list[int] = field(init=False)  # per window group: the first block still held
    num_prompt_tokens: int = field(init=False)
    num_cached_tokens: int = field(init=False)  # served from cache
    num_computed_tokens: int = field(init=False)  # KV written (or reused) so far
    num_stored_blocks: int = field(init=False)  # leading full blocks holding an identity

    def __post_init__(self, num_cached_blocks: int) -> None:
        self.block_table = list(map(BLOCK_ID, self.blocks))
        self.window_tables = [[NO_PAGE if p is None else p.block_id for p in row]
                              for row in self.window_pages]  # fmt: skip
        self.window_from = [_first_held(row) for row in self.window_pages]
        self.num_prompt_tokens = len(self.keys.prompt_bytes) // TOKEN_BYTES
        self.num_cached_tokens = self.num_computed_tokens = num_cached_blocks * self.block_size
        self.num_stored_blocks = num_cached_blocks

    @property
    def cache_salt(self) -> str | None:
        return self.keys.cache_salt

    @property
    def extras(self) -> dict[int, Extras]:
        return self.keys.extras

    @property
    def cap_last_token(self) -> bool:
        return self.keys.cap_last_token

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={len(self.token_ids)}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )

    def clone(self, request_id: str) -> Sequence:
        """A copy sharing the same blocks and window pages (the caller takes the extra
        references)."""
        child = Sequence(
            request_id,
            self.block_size,
            list(self.token_ids),
            list(self.blocks),
            self.keys,
            owner=self.owner,
            window_pages=[list(row) for row in self.window_pages],
        )
        child.num_cached_tokens = self.num_cached_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_stored_blocks = self.num_stored_blocks
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_bytes(self, index: int) -> bytes:
        """Token bytes of full block ``index``, sliced from the prompt where possible."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        prompt = self.keys.prompt_bytes
        if end * TOKEN_BYTES <= len(prompt):
            return prompt[start * TOKEN_BYTES : end * TOKEN_BYTES]
        return encode_tokens(self.token_ids[start:end])

    def parent_digest(self, index: int) -> bytes:
        """Digest the chain of block ``index`` hangs from (a held block keeps its digest)."""
        return self.blocks[index - 1].digest if index else self.keys.root_digest

    @property
    def block_hashes(self) -> list[str]:
        """Portable hex digests of every full block (computed now for uncommitted ones)."""
        return [digest.hex() for digest in self.full_block_digests()]

    def full_block_digests(self) -> list[bytes]:
        """Stored digests, extended over full blocks not yet committed."""
        digests = [block.digest for block in self.blocks[: self.num_stored_blocks]]
        parent = digests[-1] if digests else self.keys.root_digest
        blocks = (
            (self.block_bytes(index), self.extras.get(index, ()))
            for index in range(len(digests), len(self.token_ids) // self.block_size)
        )
        return digests + chain_digests(parent, blocks, self.keys.hash_fn)


def _first_held(row: list[Block | None]) -> int:
    """Index of the first page a window row holds (its length if none)."""
    return next((index for index, page in enumerate(row) if page is not None), len(row))
