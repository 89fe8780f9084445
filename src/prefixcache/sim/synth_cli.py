"""``prefixcache synth-trace``: write a synthetic trace family, with any knob changed.

Wire it into the main parser with ``add_synth_parser(subcommands)`` and dispatch
``args.command == "synth-trace"`` to ``run_synth(args)``. Every knob of ``SynthConfig`` is
a flag (``--tool-share 0.5``); unset flags keep the family's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from prefixcache.sim.synth import FAMILIES, TURN_TAILS, SynthConfig

KNOB_HELP = {
    "conversations": "conversations to generate",
    "arrival_per_s": "new conversations per second (Poisson)",
    "system_prompts": "distinct shared system prompts",
    "system_zipf": "popularity skew of the system prompts (Zipf exponent)",
    "system_tokens": "mean system prompt length (tokens)",
    "single_turn_share": "share of conversations with a single question",
    "mean_turns": "mean user turns of the other conversations (>= 2)",
    "turn_tail": "turn count distribution of multi-turn conversations",
    "user_tokens": "mean user message (tokens)",
    "output_tokens": "mean model reply (tokens)",
    "turn_gap_s": "mean think time before the next message (seconds, lognormal)",
    "tool_share": "chance that a reply is a tool call",
    "tool_tokens": "mean tool result (tokens)",
    "tool_gap_s": "mean time a tool takes (seconds)",
    "doc_share": "share of conversations opening with a document",
    "doc_tokens": "mean document (tokens)",
    "doc_one_shot": "share of document conversations with a single question",
    "seed": "random seed: the same seed gives the same trace",
}


def add_synth_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``synth-trace``: the family, the format, the output and every knob."""
    parser = subparsers.add_parser(
        "synth-trace",
        help="write a synthetic trace: multi-turn chats, shared prompts, documents, tool calls",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="chat")
    parser.add_argument(
        "--format", dest="trace_format", choices=["mooncake", "tokens"], default="mooncake",
        help="Mooncake hash ids of 512-token blocks, or our token ids (default: %(default)s)",
    )  # fmt: skip
    for knob in dataclasses.fields(SynthConfig):
        _add_knob(parser, knob)
    return parser


def _add_knob(parser: argparse.ArgumentParser, knob: dataclasses.Field) -> None:
    flag = "--" + knob.name.replace("_", "-")
    if knob.name == "turn_tail":
        parser.add_argument(flag, choices=TURN_TAILS, help=KNOB_HELP[knob.name])
        return
    kind = int if knob.type in ("int", int) else float
    parser.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=KNOB_HELP[knob.name])


def run_synth(args: argparse.Namespace) -> int:
    """Generate and write the trace; 2 with one line on stderr for a knob out of range."""
    from prefixcache.sim.synth import family_config, synth_trace, write_trace

    knobs = {knob.name: getattr(args, knob.name) for knob in dataclasses.fields(SynthConfig)}
    try:
        config = family_config(args.family, **knobs)
    except ValueError as error:
        print(f"prefixcache synth-trace: error: {error}", file=sys.stderr)
        return 2
    trace = synth_trace(config, args.trace_format, args.out)
    lines = write_trace(trace, args.out)
    print(f"{args.out}: {lines:,} requests ({args.trace_format}), family {args.family}, "
          f"{config.conversations:,} conversations, seed {config.seed}")  # fmt: skip
    return 0
