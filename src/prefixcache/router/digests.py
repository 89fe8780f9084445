"""The block digests a replica computes for a prompt, computed without a cache or a model."""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.cache.common import TOKEN_BYTES
from prefixcache.cache.hashing import (
    block_extras,
    chain_digests,
    encode_tokens,
    get_hash_function,
)

HASH_ALGO = "sha256"  # the replicas' KVCacheManager default; /health does not report it


def prompt_digests(
    root: bytes, block_size: int, token_ids: Sequence[int], cache_salt: str | None
) -> list[bytes]:
    """The chain of ``KVCacheManager.prompt_digests``: full blocks, rule 10's cap applied.

    ``root`` is the namespace digest the replicas report in ``/health``; the salt goes into
    block 0's typed extras, as on the replica.
    """
    token_bytes = encode_tokens(token_ids)
    step = block_size * TOKEN_BYTES
    blocks = (
        (
            token_bytes[index * step : (index + 1) * step],
            block_extras(index, block_size, cache_salt, None, ()),
        )
        for index in range((len(token_ids) - 1) // block_size)
    )
    return chain_digests(root, blocks, get_hash_function(HASH_ALGO))
