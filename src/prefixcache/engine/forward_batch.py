"""The tensors of one forward: every scheduled token, its position and its KV slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.engine.attention import AttentionMetadata
from prefixcache.engine.scheduler import ScheduledChunk


@dataclass(slots=True)
class ForwardBatch:
    """Inputs of ``LlamaModel.forward`` for a step, and which rows need logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor
    num_tokens: int

    @property
    def sampled(self) -> bool:
        """Whether any chunk reaches its branch's last token (so logits are needed)."""
        return self.logit_rows.numel() > 0

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], block_size: int) -> ForwardBatch:
        """Concatenate the chunks' tokens; one logits row at the end of each sampled chunk."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables, ends = [], [], [], []
        for chunk in chunks:
            seq = chunk.branch.seq
            assert seq is not None
            end = chunk.start + chunk.num_tokens
            input_ids += seq.token_ids[chunk.start : end]
            positions += range(chunk.start, end)
            query_lens.append(chunk.num_tokens)
            context_lens.append(end)
            tables.append(seq.block_table)
            if chunk.needs_logits:
                ends.append(len(input_ids) - 1)
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
        return cls(
            torch.tensor(input_ids),
            torch.tensor(positions),
            metadata,
            torch.tensor(ends, dtype=torch.long),
            len(input_ids),
        )
