"""The KV layout a replay models (issue 35): window groups beside the full group, and what a
token costs in a page at a KV dtype, so a byte budget becomes a pool. No torch.

A model has ``page_layers`` layers per group, ``window_groups`` groups of ``window`` tokens
beside its full group, and K/V rows of ``kv_heads`` x ``head_dim`` values at ``dtype``. The
``hybrid`` layout gives every group its own pages of one pool (a block takes one page per
group while held whole; window pages out of the window go back), as the engine's
``--kv-layout hybrid``; ``full`` keeps all layers of a block in one page. A capacity counts
blocks every layer holds, as the engine's ``--kv-cache-blocks``: both layouts of one
capacity take the same bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefixcache.cache.groups import KVGroupSpec
from prefixcache.engine.config import DEFAULT_KV_CACHE_DTYPE, KV_LAYOUTS, kv_row_bytes


@dataclass(frozen=True, slots=True)
class KVModel:
    """A model's KV shape and the layout a replay gives it (sizes None: bytes unknown)."""

    page_layers: int = 1
    kv_heads: int | None = None
    head_dim: int | None = None
    window: int | None = None
    window_groups: int = 0
    dtype: str = DEFAULT_KV_CACHE_DTYPE
    layout: str = "hybrid"

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv layout {self.layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        if self.window_groups and self.window is None:
            raise ValueError("--window-groups needs --window TOKENS (the groups' window)")

    @property
    def windowed(self) -> bool:
        """Whether the pool has window groups (a window and the hybrid layout)."""
        return self.layout == "hybrid" and self.window is not None and self.window_groups > 0

    @property
    def groups(self) -> tuple[KVGroupSpec, ...]:
        """The manager's groups: () for one full group."""
        if not self.windowed:
            return ()
        full = KVGroupSpec(self.page_layers)
        return (full,) + (KVGroupSpec(self.page_layers, self.window),) * self.window_groups

    @property
    def pages_per_block(self) -> int:
        return 1 + self.window_groups if self.windowed else 1

    @property
    def layers_per_page(self) -> int:
        """A group's layers (hybrid), or every layer of the model (full)."""
        if self.windowed:
            return self.page_layers
        return self.page_layers * (1 + self.window_groups)

    @property
    def page_token_bytes(self) -> int | None:
        """Bytes one token takes in one page, K and V (None: sizes not given)."""
        if self.kv_heads is None or self.head_dim is None:
            return None
        row = kv_row_bytes(self.head_dim, self.dtype)
        return self.layers_per_page * 2 * self.kv_heads * row

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block every layer holds (``pages_per_block`` pages)."""
        if self.page_token_bytes is None:
            raise ValueError(
                "--kv-cache-bytes needs a token's size: --model-layout NAME, or --kv-heads "
                "and --head-dim (and --page-layers)"
            )
        return self.page_token_bytes * block_size * self.pages_per_block

    def capacity_for(self, budget: int, block_size: int) -> int:
        """Blocks every layer holds that ``budget`` bytes fit; ValueError below one."""
        per_block = self.block_bytes(block_size)
        if budget < per_block:
            raise ValueError(
                f"--kv-cache-bytes {budget:,} is below one block of every layer "
                f"({per_block:,} bytes at {block_size} tokens, {self.dtype})"
            )
        return budget // per_block

    def describe(self) -> str:
        """One line: the layout, its groups, the dtype and a token's bytes in a page."""
        if self.windowed:
            shape = (
                f"hybrid: 1 full + {self.window_groups} window groups ({self.window} tokens) "
                f"of {self.page_layers} layers"
            )
        else:
            shape = f"full: one group of {self.layers_per_page} layers"
        size = self.page_token_bytes
        cost = "token size not given" if size is None else f"{size:,} bytes a token a page"
        return f"kv layout {shape}, {self.dtype}, {cost}"

    def with_changes(self, **changes: object) -> KVModel:
        """A copy with the given fields set (None values are left as they are)."""
        given = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **given)  # type: ignore[arg-type]


# The packaged models' KV shapes (their GGUF headers; tests/test_sim_windows.py checks them
# against the files and the engine's own layout).
MODEL_LAYOUTS = {
    "smollm2": KVModel(page_layers=30, kv_heads=3, head_dim=64),
    "gemma3-270m": KVModel(page_layers=3, kv_heads=1, head_dim=256, window=512, window_groups=5),
}
