"""Tensors on anonymous mappings of their own, never asked for transparent huge pages.

numpy advises its large arrays MADV_HUGEPAGE, and glibc hands freed memory out again: a
torch tensor can land in a range numpy advised, and carry the advice. Where the kernel then
compacts memory to find each 2 MB page (its default defrag=madvise), the first write into
each 2 MB stalled ~25 ms (a 512 MB KV pool's first touch: 6.0 s against 0.35 s,
docs/benchmarks.md, issue 36). A mapping of its own has no advice, whatever ran before.
"""

from __future__ import annotations

import math
import mmap

import torch


def anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous mapping: the OS hands out zeroed pages as they are first
    touched, so a GiB pool costs nothing at start-up (torch.zeros writes every byte now)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
