"""The tensors of one forward: every scheduled token, its position and its KV slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from prefixcache.engine.attention import AttentionMetadata, window_view
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
    def build(
        cls, chunks: list[ScheduledChunk], block_size: int, windows: Sequence[int] = ()
    ) -> ForwardBatch:
        """Concatenate the chunks' tokens; one logits row at the end of each sampled chunk.

        ``windows``: the window groups' sizes (a hybrid layout), each read through its own
        pages (``Sequence.window_tables``)."""
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
        if windows:
            seqs = [chunk.branch.seq for chunk in chunks]
            views = tuple(
                window_view(
                    query_lens, context_lens, [s.window_tables[g] for s in seqs], block_size, w
                )
                for g, w in enumerate(windows)
            )
            metadata = replace(metadata, group_views=views)
        return cls(
            torch.tensor(input_ids),
            torch.tensor(positions),
            metadata,
            torch.tensor(ends, dtype=torch.long),
            len(input_ids),
        )
