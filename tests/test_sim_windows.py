"""The simulator's KV layouts (issue 35): window groups and KV dtypes at a byte budget.

A synthetic trace of multi-turn conversations that grow past the window, replayed through the
real manager all-full and hybrid at the same bytes: the hybrid pool gives back what leaves
the window, so it keeps more prefix and hits more. The presets are checked against the
packaged GGUF files (read by gguf-py) and the engine's own layout.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from gemma_fixtures import gemma_file
from hf_fixtures import gguf_reader
from prefixcache.engine.config import KV_CACHE_DTYPES, ModelConfig, kv_row_bytes
from prefixcache.engine.model_files import model_source
from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.kv_model import MODEL_LAYOUTS, KVModel
from prefixcache.sim.replay import replay
from prefixcache.sim.traces import MooncakeRequest, TokenRequest, Trace

BLOCK = 16
WINDOW = 64
# 1 layer a group, 1 KV head of 8 float32 values: 64 bytes a token a page; 3 window groups.
SMALL = KVModel(page_layers=1, kv_heads=1, head_dim=8, window=WINDOW, window_groups=3)
SMALL_FLAGS = ["--window", "64", "--window-groups", "3", "--kv-heads", "1", "--head-dim", "8"]


def conversations(count: int = 8, turns: int = 6, user: int = 40, answer: int = 24) -> list:
    """Turn after turn, each conversation's prompt is its history plus ``user`` new tokens,
    answered by ``answer`` tokens; the conversations take turns (up to 360 tokens)."""
    history: list[list[int]] = [[] for _ in range(count)]
    requests = []
    for turn in range(turns):
        for talk in range(count):
            base = talk * 100_000 + turn * 1000
            history[talk] += range(base, base + user)
            answer_ids = list(range(base + 500, base + 500 + answer))
            requests.append(TokenRequest(len(requests), list(history[talk]), answer_ids))
            history[talk] += answer_ids
    return requests


def conversation_trace() -> Trace:
    return Trace("<conversations>", "tokens", conversations())


def write_trace(path: Path) -> Path:
    lines = [
        {"timestamp": r.timestamp, "token_ids": r.token_ids, "output_token_ids": r.output_token_ids}
        for r in conversations()
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def simulate(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(["simulate", *argv]))


# ------------------------------------------------------------------ the replay
def test_hybrid_holds_more_than_all_full_at_the_same_bytes():
    trace = conversation_trace()
    full_model = KVModel(page_layers=1, kv_heads=1, head_dim=8, window=WINDOW, window_groups=3,
                         layout="full")  # fmt: skip
    full = replay(trace, 80, "lru", block_size=BLOCK, kv=full_model)
    hybrid = replay(trace, 80, "lru", block_size=BLOCK, kv=SMALL)
    assert full.kv_bytes == hybrid.kv_bytes == 80 * BLOCK * 4 * 64  # 4 layers, 64 B each
    assert (full.pages, hybrid.pages) == (80, 320)
    assert hybrid.token_hit_rate >= 2 * full.token_hit_rate > 0
    assert full.window_pages_released == full.window_pages_evicted == 0
    assert hybrid.window_pages_released > hybrid.window_pages_evicted > 0
    assert hybrid.window_lost_tokens > 0  # pressure took a window a full-layer hit needed
    # all-full: every layer of every cached token; hybrid: the full group's page, and each
    # window group's pages only where a window was kept (under a quarter of the tokens here).
    assert full.bytes_per_cached_token == {"full": 256.0}
    per_group = hybrid.bytes_per_cached_token
    assert list(per_group) == ["full", "window1", "window2", "window3"]
    assert per_group["full"] == 64.0 and all(0 < per_group[g] < 64 for g in list(per_group)[1:])
    assert hybrid.kv_bytes_per_cached_token < 0.75 * full.kv_bytes_per_cached_token


def test_a_roomy_pool_hits_the_same_in_both_layouts_and_windows_lose_nothing():
    """Nothing is evicted: a window page is only released, never lost, and both layouts
    serve every repeated prefix (hit rates equal)."""
    trace = conversation_trace()
    full = replay(trace, 2000, "lru", block_size=BLOCK, kv=KVModel(layout="full"))
    hybrid = replay(trace, 2000, "lru", block_size=BLOCK, kv=SMALL)
    assert hybrid.hits_per_request == full.hits_per_request and full.hit_tokens > 0
    assert hybrid.window_pages_released > 0
    assert hybrid.window_pages_evicted == hybrid.window_lost_tokens == 0


def test_a_window_group_on_a_hash_id_trace_is_refused():
    trace = Trace("m.jsonl", "mooncake", [MooncakeRequest(0, 1024, 0, [1, 2])])
    with pytest.raises(ValueError, match=r"--window needs a trace of token ids: m.jsonl"):
        replay(trace, 8, kv=SMALL)
    full = replay(trace, 8, kv=MODEL_LAYOUTS["smollm2"])  # all-full: ids are fine
    assert full.kv_bytes == 8 * 512 * 30 * 2 * 3 * 64 * 4  # a block: 512 tokens


# ------------------------------------------------------------------ bytes
@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 256])
def test_row_bytes_without_torch_match_the_engine_store(dtype, head_dim):
    from prefixcache.engine.kv_store import kv_dtype, row_bytes

    assert kv_row_bytes(head_dim, dtype) == row_bytes(head_dim, kv_dtype(dtype))


def test_a_byte_budget_becomes_blocks_of_every_layer_at_each_dtype():
    gemma = MODEL_LAYOUTS["gemma3-270m"]
    # 18 layers x K and V x 1 head x 256 values: float32 36,864 B a token, bf16 18,432,
    # int8 18,720 (256 codes + a 4-byte scale a row)
    per_token = {"float32": 18 * 2 * 1024, "bfloat16": 18 * 2 * 512, "int8": 18 * 2 * 260}
    for dtype, size in per_token.items():
        model = gemma.with_changes(dtype=dtype)
        assert model.block_bytes(BLOCK) == size * BLOCK
        assert model.with_changes(layout="full").block_bytes(BLOCK) == size * BLOCK
        assert model.capacity_for(2**30, BLOCK) == 2**30 // (size * BLOCK)
    with pytest.raises(
        ValueError, match=r"1,000 is below one block of every layer \(589,824 bytes"
    ):
        gemma.capacity_for(1000, BLOCK)
    with pytest.raises(ValueError, match="needs a token's size"):
        KVModel(window=64, window_groups=1).capacity_for(10**9, BLOCK)


# ------------------------------------------------------------------ presets
def gguf_fields(path: Path) -> dict:
    """A GGUF file's numeric metadata, read by gguf-py (not our loader), and the vocabulary's
    size (its strings left undecoded)."""
    fields = gguf_reader(path).fields  # parsed once per worker: the Gemma group shares it
    meta = {key: fields[key].contents() for key in fields if not key.startswith("tokenizer.")}
    return {**meta, "vocab_size": len(fields["tokenizer.ggml.tokens"].data)}


def test_the_gemma3_preset_is_the_engines_layout_of_the_real_file():
    meta = gguf_fields(gemma_file())
    arch = meta["general.architecture"]
    layers, window = meta[f"{arch}.block_count"], meta[f"{arch}.attention.sliding_window"]
    # Gemma 3: every 6th layer full (the file has no pattern key; the engine's default).
    assert f"{arch}.attention.sliding_window_pattern" not in meta
    config = ModelConfig(
        vocab_size=meta["vocab_size"], hidden_size=meta[f"{arch}.embedding_length"],
        intermediate_size=meta[f"{arch}.feed_forward_length"], num_layers=layers,
        num_heads=meta[f"{arch}.attention.head_count"],
        num_kv_heads=meta[f"{arch}.attention.head_count_kv"],
        head_dim=meta[f"{arch}.attention.key_length"], sliding_window=window,
        window_layers=tuple(layer % 6 < 5 for layer in range(layers)),
    )  # fmt: skip
    from prefixcache.engine.kv_layout import kv_layout

    layout, preset = kv_layout(config), MODEL_LAYOUTS["gemma3-270m"]
    assert preset.groups == layout.groups
    assert (preset.page_layers, preset.window_groups) == (layout.page_layers, 5)
    assert (preset.kv_heads, preset.head_dim) == (config.num_kv_heads, config.head_dim)
    assert preset.page_layers * (1 + preset.window_groups) == layers == 18


def test_the_smollm2_preset_matches_its_file():
    meta = gguf_fields(model_source("smollm2"))
    heads = meta["llama.attention.head_count"]
    preset = MODEL_LAYOUTS["smollm2"]
    assert preset.page_layers == meta["llama.block_count"]
    assert preset.kv_heads == meta["llama.attention.head_count_kv"]
    assert preset.head_dim == meta["llama.embedding_length"] // heads
    assert preset.page_token_bytes == 46_080  # the "46 KB per token" in float32
    assert not preset.windowed and preset.groups == ()


# ------------------------------------------------------------------ the CLI
def test_simulate_prints_the_layout_table_at_a_byte_budget(tmp_path, capsys):
    trace = write_trace(tmp_path / "talks.jsonl")
    budget = str(80 * BLOCK * 4 * 64)  # 80 blocks of every layer
    common = [str(trace), "--policy", "lru", "--quiet", "--kv-cache-bytes", budget, *SMALL_FLAGS]
    out_file = tmp_path / "r.json"
    assert simulate(*common, "--out", str(out_file)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("kv layout hybrid"))
    assert "1 full + 3 window groups (64 tokens) of 1 layers, float32, 64 bytes a token" in out
    assert lines[start + 1].split() == ["capacity", "pages", "KV", "MiB", "policy", "token",
                                        "%", "released", "evicted", "lost", "tok", "B/token",
                                        "full", "windows"]  # fmt: skip
    row = lines[start + 2].split()
    assert row[:4] == ["80", "320", "0.3", "lru"]
    hybrid = json.loads(out_file.read_text())["results"][0]
    assert float(row[4]) == round(100 * hybrid["token_hit_rate"], 2)
    assert int(row[5]) == hybrid["window_pages_released"] > 0
    assert row[9] == "64.0"
    assert "optimum" not in out  # MIN counts whole blocks, not window pages
    assert hybrid["layout"] == "hybrid" and set(hybrid["bytes_per_cached_token"]) == {
        "full", "window1", "window2", "window3"}  # fmt: skip

    csv_file = tmp_path / "r.csv"
    assert simulate(*common, "--kv-layout", "full", "--out", str(csv_file)) == 0
    assert "kv layout full: one group of 4 layers" in capsys.readouterr().out
    full, optimum = list(csv.DictReader(csv_file.read_text().splitlines()))
    assert optimum["policy"] == "optimum"  # all-full: MIN applies
    assert (full["capacity"], full["pages"], full["layout"]) == ("80", "80", "full")
    assert full["kv_bytes"] == budget and full["window_pages_released"] == "0"
    assert float(full["kv_bytes_per_cached_token"]) == 256.0
    assert hybrid["token_hit_rate"] >= 2 * float(full["token_hit_rate"])


def test_simulate_without_kv_options_is_unchanged(tmp_path, capsys):
    trace = write_trace(tmp_path / "talks.jsonl")
    assert simulate(str(trace), "--capacity", "80", "--policy", "lru", "--quiet") == 0
    out = capsys.readouterr().out
    assert "kv layout" not in out and "optimum" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--kv-cache-bytes", "1000000", "--window", "64"],
            "--kv-cache-bytes needs a token's size",
        ),
        (["--kv-cache-bytes", "100", *SMALL_FLAGS], "--kv-cache-bytes 100 is below one block"),
        (
            ["--kv-cache-bytes", "25600", *SMALL_FLAGS],
            "largest request (23 blocks): --kv-cache-bytes 25,600 holds 6 blocks of every layer",
        ),
        (["--window-groups", "2"], "--window-groups needs --window TOKENS"),
        (["--capacity", "80", "--kv-cache-bytes", "10000000", *SMALL_FLAGS], "not both"),
        (["--capacity", "80", "--replicas", "2", *SMALL_FLAGS], "--replicas replays all-full"),
    ],
)
def test_bad_layout_options_give_one_line(tmp_path, capsys, extra, message):
    trace = write_trace(tmp_path / "talks.jsonl")
    assert simulate(str(trace), "--quiet", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixcache simulate: error: ") and message in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_windows_on_a_mooncake_trace_give_one_line(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    row = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
    path.write_text(json.dumps(row) + "\n")
    assert simulate(str(path), "--capacity", "8", "--quiet", "--window", "512") == 2
    err = capsys.readouterr().err
    assert "--window needs a trace of token ids" in err and "(mooncake) has block hash ids" in err


def test_fair_pools_retention_and_recommend_replay_the_layout_too(tmp_path, capsys):
    """The tenant, retention and --recommend replays take the same window groups: the pool
    returns whole after each (``_finish`` checks), and retention still saves hits."""
    trace = write_trace(tmp_path / "talks.jsonl")
    extra = ["--tenants", "2", "--retention-ttl", "300", "--recommend", "--out"]
    args = ["--capacity", "80", "--quiet", "--policy", "lru", *SMALL_FLAGS, *extra]
    assert simulate(str(trace), *args, str(tmp_path / "r.json")) == 0
    out = capsys.readouterr().out
    assert "tenant fairness" in out and "recommended eviction policy at 80 blocks" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert {run["layout"] for run in data["results"] + data["retention"]} == {"hybrid"}
    assert all(run["window_pages_released"] > 0 for run in data["retention"])
    assert data["retention"][1]["retention_saved_hits"] > 0
