"""The ``prefixcache`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from prefixcache.argtypes import positive_int
from prefixcache.server.cli import add_serve_parser, run_serve
from prefixcache.shutdown import forget_caught_interrupts, sigterm_as_ctrl_c

# Every other subcommand: its module, the function adding its parser, the one running it.
# Imported only when needed: `serve` parses its own options alone, so a server's start-up
# loads none of them (the router's modules pull in httpx and rich: ~0.3 s).
COMMANDS = {
    "route": ("prefixcache.router.cli", "add_route_parser", "run_route"),
    "cluster": ("prefixcache.router.cluster", "add_cluster_parser", "run_cluster"),
    "ray": ("prefixcache.on_ray.cli", "add_ray_parser", "run_ray"),
    "simulate": ("prefixcache.sim.cli", "add_simulate_parser", "run_simulate"),
    "synth-trace": ("prefixcache.sim.synth_cli", "add_synth_parser", "run_synth"),
    "explain": ("prefixcache.tools.explain", "add_explain_parser", "run_explain"),
    "verify": ("prefixcache.tools.verify", "add_verify_parser", "run_verify"),
    "audit-timing": ("prefixcache.tools.audit", "add_audit_parser", "run_audit"),
    "top": ("prefixcache.tools.top", "add_top_parser", "run_top"),
    "export-tokenizer": (
        "prefixcache.tools.export_tokenizer",
        "add_export_tokenizer_parser",
        "run_export_tokenizer",
    ),
}


def build_parser(only_serve: bool = False) -> argparse.ArgumentParser:
    """All subcommands and their options (``only_serve``: ``serve``'s alone)."""
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    if not only_serve:
        lab = commands.add_parser("lab", help="the article's hash-chain lab, on the real cache")
        lab.add_argument("--block-size", type=positive_int, default=4, help="tokens per block")
        lab.add_argument(
            "--no-salt",
            action="store_true",
            help="give both tenants no salt (the article's unsafe Variation 2)",
        )
    add_serve_parser(commands)
    if not only_serve:
        for name in COMMANDS:
            _command(name, 1)(commands)
    return parser


def _command(name: str, which: int) -> Callable[..., Any]:
    """Subcommand ``name``'s add-parser function (``which`` 1) or run function (2)."""
    module, *functions = COMMANDS[name]
    return getattr(importlib.import_module(module), functions[which - 1])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script. SIGTERM stops a command as Ctrl-C does; a command
    stopped before it is up (loading a model, building kernels) exits 0 without a traceback."""
    sigterm_as_ctrl_c()
    try:
        return run_command(argv)
    except KeyboardInterrupt:
        print("prefixcache: interrupted", file=sys.stderr, flush=True)
        return 0
    finally:
        forget_caught_interrupts()  # else `python -m prefixcache.cli` may end killed (-2)


def run_command(argv: list[str] | None) -> int:
    """Parse ``argv`` and run its command: ``main`` without its signal set-up."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only_serve=argv[:1] == ["serve"]).parse_args(argv)
    if args.command == "lab":
        from prefixcache.tools import lab

        print("\n".join(lab.run(block_size=args.block_size, use_salt=not args.no_salt)))
    elif args.command == "serve":
        return run_serve(args)
    elif args.command in COMMANDS:
        return _command(args.command, 2)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
