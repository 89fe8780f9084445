"""Log-probabilities of generated and prompt tokens, from the model's raw logits.

Values are ``log_softmax`` of the logits before any sampling processor (bias, penalties,
temperature), as vLLM reports them by default. Prompt logprobs need the logits of every
prompt position, which a cached prefix does not have: a request that asks for them skips
the cache hit for its own prompt (``LLMEngine.add_request``) and they are computed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROMPT_ROWS_PER_PASS = 256  # logits rows materialised at once ([rows, vocab] floats)


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and the ``k`` most likely."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[Logprob]:
    """For each row of ``logits`` ([N, vocab]): ``token_ids[i]``'s logprob and ``ks[i]`` top."""
    scores = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(scores, dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
    k_max = max(ks, default=0)
    top_values, top_ids = torch.topk(logp, k_max, dim=-1) if k_max else (None, None)
    out = []
    for i, (token, k) in enumerate(zip(token_ids, ks, strict=True)):
        top = []
        if k and top_ids is not None:
            top = list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist(), strict=True))
        out.append(Logprob(token, float(chosen[i]), int(ranks[i]), top))
    return out


def fill_prompt_logprobs(
    slots: list[Logprob | None],
    prompt: list[int],
    hidden: torch.Tensor,
    start: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    k: int,
) -> None:
    """Fill ``slots[p]`` (the logprob of prompt token p given tokens before it) from the
    hidden rows of positions ``start .. start + len(hidden) - 1``; slots already set stay."""
    first, last = start, min(start + hidden.shape[0], len(prompt) - 1)  # positions q -> q + 1
    missing = [q for q in range(first, last) if slots[q + 1] is None]
    for i in range(0, len(missing), PROMPT_ROWS_PER_PASS):
        batch = missing[i : i + PROMPT_ROWS_PER_PASS]
        rows = torch.tensor([q - start for q in batch], dtype=torch.long)
        logits = compute_logits(hidden[rows])
        targets = [prompt[q + 1] for q in batch]
        for q, entry in zip(batch, token_logprobs(logits, targets, [k] * len(batch)), strict=True):
            slots[q + 1] = entry
