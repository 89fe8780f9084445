"""The ``prefixcache`` command line."""

from __future__ import annotations

import argparse
import sys

from prefixcache.argtypes import positive_int
from prefixcache.router.cli import add_route_parser, run_route
from prefixcache.router.cluster import add_cluster_parser, run_cluster
from prefixcache.server.cli import add_serve_parser, run_serve
from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.synth_cli import add_synth_parser, run_synth
from prefixcache.tools.audit import add_audit_parser, run_audit
from prefixcache.tools.explain import add_explain_parser, run_explain
from prefixcache.tools.export_tokenizer import add_export_tokenizer_parser, run_export_tokenizer
from prefixcache.tools.verify import add_verify_parser, run_verify


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their options."""
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser("lab", help="the article's hash-chain lab, on the real cache")
    lab.add_argument("--block-size", type=positive_int, default=4, help="tokens per block")
    lab.add_argument(
        "--no-salt",
        action="store_true",
        help="give both tenants no salt (the article's unsafe Variation 2)",
    )
    add_serve_parser(commands)
    add_route_parser(commands)
    add_cluster_parser(commands)
    add_simulate_parser(commands)
    add_synth_parser(commands)
    add_explain_parser(commands)
    add_verify_parser(commands)
    add_audit_parser(commands)
    add_export_tokenizer_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    if args.command == "lab":
        from prefixcache.tools import lab

        print("\n".join(lab.run(block_size=args.block_size, use_salt=not args.no_salt)))
    elif args.command == "serve":
        return run_serve(args)
    elif args.command == "simulate":
        return run_simulate(args)
    elif args.command in COMMANDS:
        return COMMANDS[args.command](args)
    return 0


COMMANDS = {
    "route": run_route,
    "cluster": run_cluster,
    "explain": run_explain,
    "verify": run_verify,
    "audit-timing": run_audit,
    "export-tokenizer": run_export_tokenizer,
    "synth-trace": run_synth,
}


if __name__ == "__main__":
    sys.exit(main())
