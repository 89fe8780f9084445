"""The trace generator: deterministic, valid in both formats, shaped by its knobs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixcache.sim.synth import (
    FAMILIES,
    SynthConfig,
    family_config,
    synth_requests,
    synth_trace,
    write_trace,
)
from prefixcache.sim.synth_cli import add_synth_parser, run_synth
from prefixcache.sim.traces import MOONCAKE_BLOCK_TOKENS, load_trace

SMALL = {"conversations": 40}


def synth(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_synth_parser(parser.add_subparsers(dest="command", required=True))
    return run_synth(parser.parse_args(["synth-trace", *argv]))


@pytest.mark.parametrize("trace_format", ["mooncake", "tokens"])
def test_same_seed_same_file_other_seed_other_file(tmp_path, trace_format):
    paths = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        paths.append(tmp_path / f"{name}.jsonl")
        args = ["--family", "mixed", "--conversations", "30", "--seed", str(seed)]
        assert synth(str(paths[-1]), "--format", trace_format, *args) == 0
    a, b, c = (path.read_bytes() for path in paths)
    assert a == b and a != c


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_writes_a_valid_mooncake_trace(tmp_path, family):
    config = family_config(family, **SMALL)
    path = tmp_path / "t.jsonl"
    write_trace(synth_trace(config), path)
    trace = load_trace(path)  # validates block counts and the prefix chaining
    assert trace.kind == "mooncake" and len(trace.requests) >= config.conversations
    stamps = [request.timestamp for request in trace.requests]
    assert stamps == sorted(stamps)


def test_each_turn_resends_the_history_and_the_reply(tmp_path):
    config = family_config("chat", conversations=20, single_turn_share=0.0)
    path = tmp_path / "t.jsonl"
    write_trace(synth_trace(config, "tokens"), path)
    requests = load_trace(path, "tokens").requests
    extended = 0
    for earlier in requests:  # some later request starts with this prompt and its reply
        history = earlier.token_ids + earlier.output_token_ids
        follow = [r for r in requests if r.token_ids[: len(history)] == history]
        extended += bool(follow) and all(len(r.token_ids) > len(history) for r in follow)
    assert extended >= len(requests) - config.conversations  # every turn but the last


def test_system_prompts_are_shared_and_documents_are_not():
    config = family_config("docs", conversations=200, doc_share=1.0, doc_one_shot=1.0)
    requests = synth_requests(config)
    assert len(requests) == 200  # one-shot documents: one request per conversation
    systems = {request.segments[0] for request in requests}
    documents = {request.segments[1] for request in requests}
    assert len(systems) <= config.system_prompts and len(documents) == 200
    lengths = [tokens for _, tokens in documents]
    assert 0.7 * config.doc_tokens < sum(lengths) / len(lengths) < 1.3 * config.doc_tokens


def test_tool_calls_follow_quickly_and_add_requests():
    quiet = synth_requests(family_config("agent", conversations=100, tool_share=0.0))
    busy = synth_requests(family_config("agent", conversations=100, tool_share=0.6))
    assert len(busy) > 1.8 * len(quiet)  # each reply a tool call with chance 0.6: ~2.5x


def test_mooncake_blocks_are_512_tokens_and_chained_across_turns():
    config = family_config("chat", conversations=30, single_turn_share=0.0)
    trace = synth_trace(config)
    for request in trace.requests:
        assert len(request.hash_ids) == -(-request.input_length // MOONCAKE_BLOCK_TOKENS)
    ids = [set(request.hash_ids) for request in trace.requests]
    assert sum(1 for a in ids for b in ids if a is not b and len(a & b) > 3) > 0


def test_knobs_out_of_range_are_refused_with_their_name(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"tool_share must be in \[0.0, 0.95\], got 1.0"):
        SynthConfig(tool_share=1.0)
    with pytest.raises(ValueError, match=r"turn_tail must be one of"):
        dataclasses.replace(FAMILIES["chat"], turn_tail="zipf")
    assert synth(str(tmp_path / "t.jsonl"), "--mean-turns", "1") == 2
    assert "mean_turns must be in [2.0, 100.0], got 1.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown family"):
        family_config("chit-chat")


def test_pareto_conversations_run_longer_in_the_tail():
    geometric = family_config("chat", conversations=400, single_turn_share=0.0)
    pareto = dataclasses.replace(geometric, turn_tail="pareto")
    longest = []
    for config in (geometric, pareto):
        prompts = [len(r.segments) for r in synth_requests(config)]
        longest.append(max(prompts))
    assert longest[1] > longest[0]
