"""The sampler: logit processors, greedy, temperature, min-p, top-k/p.

Order per row, as vLLM applies it: logit bias, min_tokens (stop tokens masked), repetition
penalty (prompt and output tokens), frequency and presence penalties (output tokens), then
greedy argmax, or temperature, min-p, top-k, top-p and one seeded draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.engine.constrained import apply_mask
from prefixcache.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class History:
    """What a row's processors look at: its prompt, its output so far, its stop tokens."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Sequence[int] = ()  # masked until min_tokens (EOS included)


def make_generator(seed: int) -> torch.Generator:
    """A private random stream, so one request's draws never depend on another's."""
    return torch.Generator().manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[History] | None = None,
    masks: dict[int, torch.Tensor] | None = None,
) -> list[int]:
    """One token per row of ``logits`` ([N, vocab]), each row with its own params.

    ``masks``: row -> bool tensor of the tokens its grammar allows (the other rows untouched).
    """
    processed = histories is not None and any(p.processes_logits for p in params)
    if processed or masks:
        logits = logits.clone()
    if processed:
        assert histories is not None
        for row, (param, history) in enumerate(zip(params, histories, strict=True)):
            if param.processes_logits:
                logits[row] = process_logits(logits[row], param, history)
    for row, allowed in (masks or {}).items():
        logits[row] = apply_mask(logits[row], allowed)
    greedy_ids = greedy(logits)
    tokens = []
    for row, (param, generator) in enumerate(zip(params, generators, strict=True)):
        if param.greedy:
            tokens.append(greedy_ids[row])
        else:
            tokens.append(_sample_row(logits[row], param, generator))
    return tokens


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first on a tie, as torch's: numpy's vectorized argmax takes
    3 us for SmolLM2's 49,152 logits where torch's takes 64 (on every step of a decode)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return logits.detach().numpy().argmax(axis=-1).tolist()


def process_logits(row: torch.Tensor, param: SamplingParams, history: History) -> torch.Tensor:
    """Bias, min_tokens, repetition, frequency and presence penalties on one row."""
    row = row.clone()
    vocab = row.numel()
    if param.logit_bias:
        ids = torch.tensor(list(param.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(param.logit_bias.values()), dtype=row.dtype)
    if len(history.output_token_ids) < param.min_tokens and history.stop_token_ids:
        row[torch.tensor(list(history.stop_token_ids), dtype=torch.long)] = float("-inf")
    if param.repetition_penalty != 1.0:
        seen = torch.tensor([*history.prompt_token_ids, *history.output_token_ids])
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[seen] = True
        penalty = param.repetition_penalty
        row = torch.where(mask, torch.where(row > 0, row / penalty, row * penalty), row)
    if (param.frequency_penalty or param.presence_penalty) and history.output_token_ids:
        counts = torch.bincount(
            torch.tensor(history.output_token_ids, dtype=torch.long), minlength=vocab
        ).to(row.dtype)
        row -= param.frequency_penalty * counts + param.presence_penalty * (counts > 0)
    return row


def _sample_row(logits: torch.Tensor, param: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then min-p, top-k, top-p, then one draw from this row's generator."""
    scores = logits.float() / param.temperature
    if param.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < param.min_p * probs.max(), float("-inf"))
    if param.top_k and param.top_k < scores.numel():
        kth = torch.topk(scores, param.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if param.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= param.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
