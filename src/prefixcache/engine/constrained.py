"""The per-step work of constrained branches: each one's allowed-token mask, and its advance.

A constrained branch owns a ``GrammarState`` (its llguidance matcher and how many of its
output tokens the matcher has consumed). Before sampling, ``allowed_masks`` computes a
boolean mask per constrained row (none at all when no row is constrained); ``sample``
applies it after the logit processors. After sampling, ``advance`` feeds the token; the
branch ends with "stop" once the grammar is complete and allows nothing but EOS.

The matcher follows the branch's accepted tokens (``output.token_ids``): preemption keeps
them and recomputes only their KV, so the matcher needs nothing then; ``follow`` replays
whatever it has not seen, so the two can never drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import torch

if TYPE_CHECKING:
    from prefixcache.engine.request import Branch

_BITS = torch.arange(32, dtype=torch.int32)
log = logging.getLogger("prefixcache.engine")


class GrammarState:
    """One branch's matcher, and how many of the branch's output tokens it consumed."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def follow(self, tokens: Sequence[int]) -> None:
        """Bring the matcher to the end of ``tokens`` (the branch's output so far)."""
        if self.consumed > len(tokens):  # never expected: start over from the output
            self.matcher.reset()
            self.consumed = 0
        if self.consumed < len(tokens):
            self.matcher.consume_tokens(list(tokens[self.consumed :]))
            self.consumed = len(tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no more text (or the matcher failed)."""
        return self.matcher.is_stopped()


def allowed_masks(
    branches: Sequence[Branch], vocab_size: int, eos_token_ids: Sequence[int]
) -> dict[int, torch.Tensor] | None:
    """Row -> bool mask of the tokens its grammar allows next; None if no row is constrained."""
    rows = [i for i, branch in enumerate(branches) if branch.grammar is not None]
    if not rows:
        return None
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    for slot, row in enumerate(rows):
        state = branches[row].grammar
        assert state is not None
        state.follow(branches[row].output.token_ids)
        target = bitmask[slot]
        state.matcher.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(len(rows), -1)[:, :vocab_size]
    masks = {}
    for slot, row in enumerate(rows):
        mask = allowed[slot]
        if not mask.any():  # a failed matcher allows nothing: let the branch end
            mask = mask.clone()
            mask[list(eos_token_ids)] = True
        masks[row] = mask
    return masks


def apply_mask(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``row`` with every disallowed token at -inf (the mask alone if nothing else is left)."""
    width = row.numel()
    if allowed.numel() < width:  # logits wider than the tokenizer's vocabulary
        allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.numel())])
    masked = row.masked_fill(~allowed[:width], float("-inf"))
    if torch.isneginf(masked).all():  # e.g. min_tokens masked the only allowed token, EOS
        masked = torch.zeros_like(row).masked_fill(~allowed[:width], float("-inf"))
    return masked


def advance(branch: Branch) -> bool:
    """Feed a branch's newest output token to its matcher; True once the grammar is done."""
    state = branch.grammar
    if state is None:
        return False
    state.follow(branch.output.token_ids)
    if state.matcher.is_error():  # its message quotes output text: only the branch is logged
        log.warning("the grammar matcher of %s failed; the branch ends", branch.id)
    return state.done
