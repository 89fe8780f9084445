"""``prefixcache simulate``'s KV layout options (issue 35): window groups, a KV dtype and a
byte budget, by a packaged model's name or field by field. None given: the replay is as
before (one full group, capacities in blocks)."""

from __future__ import annotations

import argparse

from prefixcache.argtypes import positive_int
from prefixcache.engine.config import KV_CACHE_DTYPES, KV_LAYOUTS
from prefixcache.sim.kv_model import MODEL_LAYOUTS, KVModel

DEFAULT_CAPACITIES = [1000, 5000, 20000]
KV_FLAGS = ("model_layout", "window", "window_groups", "page_layers", "kv_heads", "head_dim",
            "kv_cache_dtype", "kv_layout", "kv_cache_bytes")  # fmt: skip


def add_kv_options(parser: argparse.ArgumentParser) -> None:
    """Register the layout, dtype and byte-budget options."""
    kv = parser.add_argument_group(
        "KV layout", "replay as a model with sliding-window layers, at a KV budget in bytes"
    )
    kv.add_argument(
        "--model-layout", choices=sorted(MODEL_LAYOUTS),
        help="a packaged model's KV shape (gemma3-270m: 3-layer pages, 1 full + 5 window "
        "groups of 512 tokens, 1 KV head of 256); the options below override it",
    )  # fmt: skip
    kv.add_argument(
        "--window", type=positive_int, metavar="TOKENS",
        help="window groups attend to the last TOKENS tokens (token-id and CSV traces only)",
    )  # fmt: skip
    kv.add_argument(
        "--window-groups", type=positive_int, metavar="N",
        help="window groups beside the full group (default with --window: 1)",
    )  # fmt: skip
    kv.add_argument(
        "--page-layers", type=positive_int, metavar="L",
        help="layers per group (a page's; the model has L x (1 + N) layers; default 1)",
    )  # fmt: skip
    kv.add_argument("--kv-heads", type=positive_int, metavar="N", help="KV heads per layer")
    kv.add_argument("--head-dim", type=positive_int, metavar="D", help="values per KV head")
    kv.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="the pool's K/V dtype, as serve's (int8: head_dim + 4 bytes a row; default float32)",
    )  # fmt: skip
    kv.add_argument(
        "--kv-layout", choices=KV_LAYOUTS,
        help="hybrid (default): each group its own pages, window pages out of the window "
        "freed; full: every layer of a block in one page, as without windows",
    )  # fmt: skip
    kv.add_argument(
        "--kv-cache-bytes", type=positive_int, nargs="+", metavar="BYTES",
        help="KV budgets in bytes instead of --capacity: each the blocks of every layer it "
        "holds (needs a token's size: --model-layout, or --kv-heads and --head-dim)",
    )  # fmt: skip


def kv_model_of(args: argparse.Namespace) -> KVModel | None:
    """The model the options describe (None: no option given); ValueError for a bad mix."""
    if all(getattr(args, name) is None for name in KV_FLAGS):
        return None
    base = MODEL_LAYOUTS[args.model_layout] if args.model_layout else KVModel()
    groups = args.window_groups
    if args.window is not None and groups is None and not base.window_groups:
        groups = 1
    return base.with_changes(
        page_layers=args.page_layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        window=args.window,
        window_groups=groups,
        dtype=args.kv_cache_dtype,
        layout=args.kv_layout,
    )


def capacities_of(args: argparse.Namespace, kv: KVModel | None, block_tokens: int) -> list[int]:
    """Capacities in blocks every layer holds: ``--capacity``, or each ``--kv-cache-bytes``
    over a block's bytes (``block_tokens`` tokens a block)."""
    if not args.kv_cache_bytes:
        return list(args.capacity or DEFAULT_CAPACITIES)
    if args.capacity:
        raise ValueError("give --capacity (blocks) or --kv-cache-bytes (bytes), not both")
    assert kv is not None, "--kv-cache-bytes is a KV option"
    return [kv.capacity_for(budget, block_tokens) for budget in args.kv_cache_bytes]
