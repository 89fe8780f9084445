"""The KV pool and the packed weights are never asked for transparent huge pages.

numpy madvises its large arrays MADV_HUGEPAGE; with the kernel's default defrag=madvise, each
first touch of 2 MB of such memory compacts memory first. Here that cost ~25 ms a 2 MB: a
32-token chunk that wrote into fresh pool pages took 0.8 s, and Gemma 3's weights took 1.5 s
longer to copy. The memory must come from mappings without the flag (smaps' "hg"):
`anonymous_memory.anonymous_zeros`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prefixcache.engine.config import ModelConfig
from prefixcache.engine.kv_store import KVStore
from prefixcache.engine.weight_types import WEIGHT_TYPES_BY_NAME, PackedWeight
from prefixcache.engine.weight_types.random_blocks import random_blocks


def vm_flags(tensor: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds `tensor`'s middle byte (/proc/self/smaps; numpy
    advises from the first whole page on, so its first byte may sit in a mapping apart)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None, "no mapping holds the tensor"
    return flags


def test_numpy_would_ask_for_huge_pages_here() -> None:
    """The check below can fail: a large numpy array does carry the flag on this machine."""
    array = np.zeros(64 << 20, dtype=np.uint8)
    assert "hg" in vm_flags(torch.from_numpy(array))


def test_the_kv_pool_is_not_on_huge_page_advice() -> None:
    config = ModelConfig(name="t", vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    store = KVStore.for_model(config, 4096, 16, torch.float32)
    assert store.layers[0].numel() * 4 >= 8 << 20
    for layer in store.layers:
        assert "hg" not in vm_flags(layer)
        layer.view(-1)[:: 1 << 20] = 1.0  # writable, and zero elsewhere
        assert float(layer.view(-1)[1]) == 0.0


def test_packed_weights_are_not_on_huge_page_advice() -> None:
    """Not even after numpy freed advised memory that malloc could hand out again (copied into
    torch's own memory, 4 weights in 20 landed there and carried the advice; it failed CI)."""
    q8 = WEIGHT_TYPES_BY_NAME["Q8_0"]
    for megabytes in range(8, 28):
        freed = np.zeros(megabytes << 20, dtype=np.uint8)
        freed[::4096] = 1
        del freed
        weight = PackedWeight.from_gguf(random_blocks(q8, 16384, 512), q8.code, (16384, 512))
        assert weight.nbytes >= 8 << 20
        assert "hg" not in vm_flags(weight.blocks), f"after a freed {megabytes} MB array"
