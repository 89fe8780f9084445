"""``prefixcache verify``: identical tokens with caching on and off, and a fault is caught."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine_fixtures import default_model, tiny_model
from prefixcache.cli import main
from prefixcache.tools import verify
from prefixcache.tools.request_file import InputError
from prefixcache.tools.workload import builtin_workload, load_workload


def tiny_workload(requests: int = 6, max_tokens: int = 6, seed: int = 3):
    return builtin_workload(tiny_model().config.vocab_size, requests, max_tokens, seed)


def test_tiny_pool_evicts_preempts_and_stays_identical_even_zeroing():
    options = verify.VerifyOptions(block_size=4, tiny_pool=True, zero_on_evict=True)
    status, lines = verify.verify(tiny_model(), tiny_workload(8, seed=2), options)
    report = "\n".join(lines)
    assert status == 0, report
    assert "tiny pool" in report and "identical" in report and "both pools clean" in report
    cached_line = next(line for line in lines if "cached run:" in line)
    counts = re.search(r"(\d+) evictions, (\d+) preemptions", cached_line)
    assert int(counts[1]) > 0 and int(counts[2]) > 0, cached_line


def corrupt_after_first_hit(monkeypatch) -> None:
    """The fault: once a request has reused blocks, scribble over its first block's K/V."""
    make = verify.make_engine

    def make_faulty(loaded, caching, num_blocks, options):
        engine = make(loaded, caching, num_blocks, options)
        if caching:
            step, done = engine.step, []

            def faulty_step():
                outputs = step()
                hit = [b for b in engine.scheduler.running if b.seq and b.seq.num_cached_tokens]
                if hit and not done:
                    noise = torch.Generator().manual_seed(0)
                    for layer in engine.kv_store.layers:
                        block = layer[hit[0].seq.block_table[0]]
                        block.add_(torch.randn(block.shape, generator=noise, dtype=block.dtype))
                    done.append(hit[0].id)
                return outputs

            engine.step = faulty_step
        return engine

    monkeypatch.setattr(verify, "make_engine", make_faulty)


def test_a_corrupted_kv_block_is_reported_with_exit_status_1(monkeypatch):
    corrupt_after_first_hit(monkeypatch)
    status, lines = verify.verify(tiny_model(), tiny_workload(), verify.VerifyOptions(block_size=4))
    assert status == 1
    mismatch = lines[-1]
    assert mismatch.startswith("MISMATCH request w") and "output position" in mismatch
    assert "cached " in mismatch and "uncached " in mismatch


def test_the_default_model_gives_identical_tokens(monkeypatch, capsys):
    monkeypatch.setattr("prefixcache.engine.weights.load_model", lambda _=None: default_model())
    status = main(["verify", "--requests", "3", "--max-tokens", "3", "--tiny-pool"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "identical" in out and "both pools clean" in out


def test_workload_files_tokens_and_turns(tmp_path):
    lines = [
        {"id": "a", "token_ids": [5, 6, 7, 8, 9], "max_tokens": 2},
        {"id": "b", "prompt": "hello there", "n": 2, "temperature": 0.7, "seed": 4},
        {"id": "a2", "token_ids": [11], "round": 1, "continues": "a"},
    ]
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second = load_workload(path, tiny_model().tokenizer)
    assert [item.request_id for item in first] == ["a", "b"] and second[0].continues == "a"
    assert first[1].token_ids and first[1].params.n == 2
    status, report = verify.verify(tiny_model(), [first, second], verify.VerifyOptions(4))
    assert status == 0, report


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "x"}', "line 1: fields token_ids/prompt/messages: give one (found none)"),
        ('{"token_ids": [1], "max_tokens": 0}', "line 1: field 'max_tokens': expected an integer"),
        ('{"token_ids": [1], "continues": "zz"}', "line 1: field 'continues'"),
        ('{"token_ids": [1], "lora_name": "x"}', "line 1: field 'lora_name'"),
        ("not json", "line 1: not valid JSON"),
    ],
)
def test_bad_workload_lines_name_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=re.escape(f"w.jsonl {message}")):
        load_workload(path, None)
