"""How a model's layers map onto the pool's pages: the KV cache groups (issue 35).

`full` (every model, and `--kv-layout full`): one group; a page holds every layer of a
block. `hybrid` (a model with sliding-window layers): a page holds F layers, F the number
of full-attention layers; group 0 is those layers, each window group F window layers (the
last one padded), so one pool of one page size serves every group (vLLM's rule of equal
layer counts). Layer `l` keeps its K/V in physical tensor `slot[l]`, at the page ids of
group `group[l]`'s block table.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.cache.common import cdiv
from prefixcache.cache.groups import KVGroupSpec
from prefixcache.engine.config import DEFAULT_KV_LAYOUT, KV_LAYOUTS, ModelConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Groups of one page size, and each layer's group and physical tensor."""

    name: str
    groups: tuple[KVGroupSpec, ...]  # () when there is one full group
    group: tuple[int, ...]  # per layer: its group
    slot: tuple[int, ...]  # per layer: its physical tensor
    page_layers: int  # physical tensors (layers a page holds)

    @property
    def num_window_groups(self) -> int:
        return max(0, len(self.groups) - 1)

    def describe(self, page_token_bytes: int) -> str:
        """One line for the start-up banner."""
        if not self.groups:
            return "layout full: one group, every layer keeps every token"
        window = self.groups[1].window
        return (
            f"layout hybrid: 1 full + {self.num_window_groups} window groups ({window} tokens) "
            f"of {self.page_layers} layers, {page_token_bytes:,} bytes a token a group"
        )

    @property
    def pages_per_block(self) -> int:
        """Pages one block takes while every group holds it."""
        return 1 + self.num_window_groups


def kv_layout(config: ModelConfig, name: str = DEFAULT_KV_LAYOUT) -> KVLayout:
    """The layout `name` gives `config`; ValueError naming the choices."""
    if name not in KV_LAYOUTS:
        raise ValueError(f"kv_layout {name!r} is not one of {', '.join(KV_LAYOUTS)}")
    layers = range(config.num_layers)
    windowed = [config.is_window_layer(layer) for layer in layers]
    full = [layer for layer in layers if not windowed[layer]]
    if name == "full" or not any(windowed) or not full:
        return KVLayout("full", (), (0,) * len(layers), tuple(layers), len(layers))
    page = len(full)
    window = [layer for layer in layers if windowed[layer]]
    group, slot = [0] * len(layers), [0] * len(layers)
    for index, layer in enumerate(full):
        slot[layer] = index
    for index, layer in enumerate(window):
        group[layer], slot[layer] = 1 + index // page, index % page
    num_window_groups = cdiv(len(window), page)
    groups = (KVGroupSpec(page),) + (KVGroupSpec(page, config.sliding_window),) * num_window_groups
    return KVLayout("hybrid", groups, tuple(group), tuple(slot), page)
