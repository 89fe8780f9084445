"""Checks on what callers hand the cache: each error names the problem and the limit."""

from __future__ import annotations

import math
from collections.abc import Sequence

from prefixcache.cache.common import cdiv
from prefixcache.cache.hashing import MAX_TOKEN_ID, MultiModalItem, encode_tokens


class CapacityError(ValueError):
    """A request that can never fit: it needs more blocks than the whole pool holds."""


def check_prompt(token_ids: Sequence[int]) -> None:
    """A prompt is a non-empty list of token ids (each id is checked when encoded)."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ValueError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty: a prompt needs at least 1 token")


def check_token_ids(token_ids: Sequence[int]) -> None:
    """Each id is an int in [0, 2**32); the error names the first bad one."""
    if type(token_ids) is not list and (
        isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence)
    ):
        raise ValueError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    for token in token_ids:
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            encode_tokens(token_ids)  # raises the precise error, or accepts int-likes
            return


def check_optional_str(name: str, value: object) -> None:
    """``cache_salt`` and ``lora_name`` are strings or None."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or None, got {type(value).__name__}")


def check_mm_items(items: Sequence[MultiModalItem], num_tokens: int) -> None:
    """Each multimodal item lies inside the prompt and has a non-empty identifier."""
    for index, item in enumerate(items):
        if not isinstance(item, MultiModalItem):
            raise ValueError(f"mm_items[{index}] must be a MultiModalItem")
        if not item.identifier:
            raise ValueError(f"mm_items[{index}].identifier is empty")
        if item.offset < 0 or item.length < 1 or item.offset + item.length > num_tokens:
            raise ValueError(
                f"mm_items[{index}] covers [{item.offset}, {item.offset + item.length}),"
                f" outside the prompt's {num_tokens} tokens"
            )


def check_fits(
    num_tokens: int, block_size: int, total: int, num_generated: int = 0, pages: int = 1
) -> None:
    """CapacityError for a prompt that, with ``num_generated`` more tokens, outgrows the pool.

    The one capacity check: the cache applies it at admission, the engine when a request
    arrives (reserving room for the first generated token). ``pages``: pool pages a block
    takes while a prompt computes (1 + its window groups in a hybrid pool).
    """
    needed = cdiv(num_tokens + num_generated, block_size) * pages
    if needed > total:
        room = "; 1 more is generated" if num_generated == 1 else ""
        each = f" ({pages} pages a block while it computes: 1 + window groups)" if pages > 1 else ""
        raise CapacityError(
            f"the prompt has {num_tokens} tokens and needs {needed} KV blocks{each}; the pool "
            f"has {total} blocks ({total // pages * block_size} tokens at block size "
            f"{block_size}{room})"
        )


def check_retention(num_tokens: object, ttl_seconds: object, retention_class: object) -> None:
    """``retain``'s arguments: tokens an int >= 0, a finite ttl > 0, a class name."""
    if type(num_tokens) is not int or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    valid = isinstance(ttl_seconds, (int, float)) and not isinstance(ttl_seconds, bool)
    if not valid or not math.isfinite(ttl_seconds) or ttl_seconds <= 0:
        raise ValueError(f"ttl_seconds must be a finite number > 0, got {ttl_seconds!r}")
    if not isinstance(retention_class, str):
        raise ValueError(f"retention_class must be a string, got {retention_class!r}")


MAX_KEEPS = 8  # retention marks per request (Anthropic allows 4 breakpoints, OpenAI one)


def check_keeps(keeps: object, prompt_len: int) -> tuple:
    """A request's retention asks: at most MAX_KEEPS, each valid and within the prompt."""
    if not isinstance(keeps, (tuple, list)) or len(keeps) > MAX_KEEPS:
        raise ValueError(f"retention must be a list of at most {MAX_KEEPS} keeps, got {keeps!r}")
    for keep in keeps:
        check_retention(*keep)
        if keep[0] > prompt_len:
            raise ValueError(
                f"retention num_tokens {keep[0]} is past the prompt's {prompt_len} tokens"
            )
    return tuple(keeps)
