"""Cascade attention over shared prefix blocks: exact vs Hugging Face and vs the plain path."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from engine_fixtures import run_to_completion, tiny_engine
from prefixcache.engine import attention
from prefixcache.engine.attention import AttentionMetadata, find_shared_prefixes
from prefixcache.engine.models.llama import LlamaModel
from prefixcache.engine.sampling import SamplingParams
from test_engine import run_workload
from test_model_logits import BLOCK, Pair, Runner, Seq, _close, _tokens, hf_logits, make_pair

# Thresholds off, so the tiny test batches take the cascade path.
CASCADE = {"min_shared_blocks": 1, "min_saved_tokens": 0}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return make_pair(tied=request.param)


def _family(runner: Runner, prefix: list[int], tails: list[list[int]]) -> list[Seq]:
    """A writer computes `prefix + tails[0]`; the others reuse its full prefix blocks."""
    writer = runner.new_seq(prefix + tails[0])
    runner.step([(writer, len(writer.tokens))])
    cached = len(prefix) // BLOCK * BLOCK
    shared = writer.block_table[: cached // BLOCK]
    readers = [runner.new_seq(prefix + tail, shared=shared, computed=cached) for tail in tails[1:]]
    return [writer, *readers]


def _check(
    runner: Runner, pair: Pair, batch: list[tuple[Seq, int]], **options: object
) -> AttentionMetadata:
    """Run `batch` with the cascade and without: both match HF; then advance it."""
    options = {**CASCADE, **options}
    plain = runner.forward(batch, share_prefixes=False)
    assert not runner.metadata.shared_prefixes
    logits = runner.step(batch, **options)
    md = runner.metadata
    for (seq, n), ours, ref in zip(batch, logits, plain, strict=True):
        _close(ours, _reference(pair, seq.tokens)[seq.computed - n : seq.computed])
        assert (ours - ref).abs().max().item() < 3e-5  # a few ulps of logits around 5
    return md


# HF model -> tokens -> logits. Keyed by the model itself, not its id(): once a module's
# pair is freed its entry goes too, so a new model at the same address never reads it.
_REFERENCES: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _reference(pair: Pair, tokens: list[int]) -> torch.Tensor:
    """HF logits for every position of `tokens`, memoized (a sequence is checked often)."""
    memo = _REFERENCES.setdefault(pair.hf, {})
    key = tuple(tokens)
    if key not in memo:
        memo[key] = hf_logits(pair, tokens)
    return memo[key]


def _groups(md: AttentionMetadata) -> list[tuple[tuple[int, ...], int]]:
    return sorted((g.seqs, g.num_tokens) for g in md.shared_prefixes)


# --- exactness on the model ------------------------------------------------------------------


def test_many_decodes_share_a_long_prefix(pair: Pair) -> None:
    runner = Runner(pair, seed=10, num_blocks=160)
    prefix = _tokens(27, 100)  # 6 full blocks shared, the 7th partial one is private
    seqs = _family(runner, prefix, [_tokens(2 + i, 101 + i) for i in range(8)])
    runner.step([(s, len(s.tokens) - s.computed) for s in seqs[1:]], **CASCADE)
    for i, s in enumerate(seqs):
        runner.append(s, _tokens(4, 1000 + i))  # the tokens the next four steps decode
    for _ in range(4):
        md = _check(runner, pair, [(s, 1) for s in seqs])
        assert _groups(md) == [(tuple(range(8)), 24)]
        assert md.decode is None and md.shared_decode is not None
        assert md.shared_decode.num_seqs == 8


def test_suffix_prefills_and_decodes_share_a_prefix(pair: Pair) -> None:
    runner = Runner(pair, seed=11, num_blocks=160)
    prefix = _tokens(20, 110)
    tails = [_tokens(5, 111), _tokens(3, 112), _tokens(4, 113), _tokens(9, 114)]
    seqs = _family(runner, prefix, tails)
    runner.step([(seqs[1], 3)])  # seqs[1] now decodes; seqs[2], seqs[3] prefill their suffixes
    runner.append(seqs[0], [7])
    runner.append(seqs[1], [8])
    lone = runner.new_seq(_tokens(6, 114))
    runner.step([(lone, 5)])
    unrelated = runner.new_seq(_tokens(7, 115))
    batch = [(seqs[2], 3), (lone, 1), (seqs[0], 1), (unrelated, 7), (seqs[3], 9), (seqs[1], 1)]
    md = _check(runner, pair, batch)
    assert _groups(md) == [((0, 2, 4, 5), 20)]
    assert isinstance(md.shared_prefixes[0].rows, torch.Tensor)  # rows not contiguous
    assert md.decode is not None and md.decode.num_seqs == 1  # `lone` takes the plain path
    assert [p.key_start for p in md.prefills] == [20, 0, 20]


def test_two_groups_in_one_batch(pair: Pair) -> None:
    runner = Runner(pair, seed=12, num_blocks=160)
    first = _family(runner, _tokens(16, 120), [_tokens(3 + i, 121 + i) for i in range(3)])
    second = _family(runner, _tokens(13, 130), [_tokens(2 + i, 131 + i) for i in range(3)])
    runner.append(first[0], [1])
    runner.append(second[0], [2])
    seqs = [s for two in zip(first, second, strict=True) for s in two]  # interleaved
    md = _check(runner, pair, [(s, len(s.tokens) - s.computed) for s in seqs])
    assert _groups(md) == [((0, 2, 4), 16), ((1, 3, 5), 12)]


def test_group_limited_by_one_query_start(pair: Pair) -> None:
    runner = Runner(pair, seed=13, num_blocks=160)
    prefix = _tokens(24, 140)
    a, b, c = _family(runner, prefix, [_tokens(2, 141), _tokens(4, 142), _tokens(3, 143)])
    runner.step([(b, 4), (c, 3)], share_prefixes=False)
    for s in (a, b, c):
        runner.append(s, [9])
    # `chunked` has cached 5 of the 6 shared blocks: all four sharing 5 blocks saves more
    # (3 * 5) than the other three sharing 6 (2 * 6).
    chunked = runner.new_seq(prefix + _tokens(3, 144), shared=a.block_table[:5], computed=20)
    md = _check(runner, pair, [(a, 1), (chunked, 7), (b, 1), (c, 1)])
    assert _groups(md) == [((0, 1, 2, 3), 20)]


def test_writer_in_the_same_batch_is_left_out(pair: Pair) -> None:
    runner = Runner(pair, seed=14, num_blocks=160)
    prefix = _tokens(16, 150)
    writer = runner.new_seq(prefix + _tokens(3, 151))
    shared = writer.block_table[:4]
    readers = [
        runner.new_seq(prefix + _tokens(4, 152 + i), shared=shared, computed=16) for i in (0, 1)
    ]
    # The readers' shared blocks are computed by the writer in this very forward.
    md = _check(runner, pair, [(readers[0], 4), (writer, 19), (readers[1], 4)])
    assert _groups(md) == [((0, 2), 16)]


def test_tables_that_diverge_midway(pair: Pair) -> None:
    runner = Runner(pair, seed=15, num_blocks=160)
    trunk, left_prefix, right_prefix = _tokens(8, 160), _tokens(16, 161), _tokens(16, 162)
    left = _family(runner, trunk + left_prefix, [_tokens(1, 163), [], _tokens(2, 164)])
    # The right branch shares the trunk's 2 blocks with the left, then 4 blocks of its own.
    right_writer = runner.new_seq(
        trunk + right_prefix + _tokens(1, 165), shared=left[0].block_table[:2], computed=8
    )
    runner.step([(right_writer, 17)])
    right = runner.new_seq(
        trunk + right_prefix + _tokens(3, 166), shared=right_writer.block_table[:6], computed=24
    )
    seqs = [*left, right_writer, right]
    for i, s in enumerate(seqs):
        runner.append(s, [20 + i])
    md = _check(runner, pair, [(s, len(s.tokens) - s.computed) for s in seqs])
    # Two groups sharing six blocks (saving 2 * 6 + 1 * 6) beat all five sharing two (4 * 2).
    assert _groups(md) == [((0, 1, 2), 24), ((3, 4), 24)]


def test_blocks_shared_by_one_sequence_only_take_the_plain_path(pair: Pair) -> None:
    runner = Runner(pair, seed=16, num_blocks=160)
    prefix = _tokens(16, 170)
    (first,) = _family(runner, prefix, [_tokens(3, 171)])
    hit = runner.new_seq(prefix + _tokens(5, 172), shared=first.block_table[:4], computed=16)
    other = runner.new_seq(_tokens(9, 173))
    md = _check(runner, pair, [(hit, 5), (other, 9)])
    assert md.shared_prefixes == () and md.shared_decode is None


def test_math_fallback_matches(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
    runner = Runner(pair, seed=17, num_blocks=160)
    seqs = _family(runner, _tokens(18, 180), [_tokens(3, 180), _tokens(2, 181), _tokens(6, 182)])
    runner.append(seqs[0], [5])
    md = _check(runner, pair, [(seqs[0], 1), (seqs[1], 2), (seqs[2], 6)])
    assert _groups(md) == [((0, 1, 2), 16)]


def test_bfloat16_cascade_matches_the_plain_path(pair: Pair) -> None:
    ours = LlamaModel(pair.config, dtype=torch.bfloat16)
    ours.load_weights(pair.hf.state_dict())
    runner = Runner(Pair(pair.hf, ours, pair.config), seed=18, num_blocks=160)
    seqs = _family(runner, _tokens(20, 190), [_tokens(3, 190), _tokens(2, 191), _tokens(5, 192)])
    runner.append(seqs[0], [5])
    batch = [(seqs[0], 1), (seqs[1], 2), (seqs[2], 5)]
    plain = runner.forward(batch, share_prefixes=False)
    cascade = runner.forward(batch, **CASCADE)
    assert runner.metadata.shared_prefixes
    for a, b in zip(cascade, plain, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b.float()).abs().max().item() < 0.05 * b.float().abs().max().item()


# --- the decision ----------------------------------------------------------------------------


def test_default_thresholds_take_the_cascade_for_a_system_prompt() -> None:
    # A 1,500-token prompt fills 93 shared blocks; its last 12 tokens sit in private ones.
    shared = list(range(93))
    tables = [shared + [1000 + 7 * i + j for j in range(7)] for i in range(64)]
    contexts = [1500 + 70 + i % 20 for i in range(64)]
    md = AttentionMetadata.build([1] * 64, contexts, tables, 16)
    assert _groups(md) == [(tuple(range(64)), 1488)]
    (group,) = md.shared_prefixes
    assert group.rows == slice(0, 64) and group.block_ids.tolist() == shared
    assert md.decode is None and md.shared_decode is not None
    assert md.shared_decode.block_ids.numel() == 64 * 7  # only the private blocks
    off = AttentionMetadata.build([1] * 64, contexts, tables, 16, share_prefixes=False)
    assert off.shared_prefixes == () and off.decode is not None


def test_default_thresholds_skip_small_savings() -> None:
    tables = [[0, 1, 2, 3, 4, 10], [0, 1, 2, 3, 4, 11], [20, 21, 22], [30, 31, 32]]
    md = AttentionMetadata.build([1] * 4, [90, 90, 40, 40], tables, 16)
    assert md.shared_prefixes == ()  # a pair sharing 80 tokens saves too little
    md = AttentionMetadata.build([1] * 4, [90, 90, 40, 40], tables, 16, min_saved_tokens=64)
    assert _groups(md) == [((0, 1), 80)]


@pytest.mark.parametrize(
    ("tables", "usable", "expected"),
    [
        # One trunk: everyone, as deep as the shortest allows.
        ([[1, 2, 3, 4]] * 3, [4, 4, 2], [([0, 1, 2], 2)]),
        # Dropping the short one saves more (2 * 4 > 3 * 2).
        ([[1, 2, 3, 4]] * 3, [4, 4, 1], [([0, 1], 4)]),
        # Split into two deep branches (3 + 3) over one shallow group (2 * 1).
        (
            [[1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 6, 7], [1, 5, 6, 7]],
            [4] * 4,
            [([0, 1], 4), ([2, 3], 4)],
        ),
        # Keep the shallow group when the branches save less (3 * 2 > 1 * 3).
        ([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 6, 7], [1, 2, 8, 9]], [4] * 4, [([0, 1, 2, 3], 2)]),
        # Different first blocks never group; a lone sequence never groups.
        ([[1, 2], [3, 4], [1, 2]], [2, 2, 2], [([0, 2], 2)]),
        ([[1, 2, 3]], [3], []),
    ],
)
def test_find_shared_prefixes_picks_the_most_saving_groups(tables, usable, expected) -> None:
    contexts = [4 * u + 1 for u in usable]
    found = find_shared_prefixes([1] * len(tables), contexts, tables, 4, min_blocks=1)
    assert sorted(found) == sorted(expected)


def test_find_shared_prefixes_respects_the_limits() -> None:
    tables = [[1, 2, 3, 4, 5]] * 3
    contexts = [21] * 3
    assert find_shared_prefixes([1] * 3, contexts, tables, 4, min_blocks=6) == []
    assert find_shared_prefixes([1] * 3, contexts, tables, 4, min_saved_blocks=11) == []
    assert find_shared_prefixes([1] * 3, contexts, tables, 4, min_saved_blocks=10) == [
        ([0, 1, 2], 5)
    ]
    with pytest.raises(ValueError):
        AttentionMetadata.build([1], [4], [[0]], 4, min_shared_blocks=0)


# --- the engine ------------------------------------------------------------------------------


def test_engine_tokens_are_the_same_with_the_cascade_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = [[5 + (i * 7919) % 300 for i in range(41)] + [400 + j, 17, 3 + j] for j in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run() -> dict[str, list[int]]:
        engine = tiny_engine(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
        engine.add_request("first", prompts[0], params)
        run_to_completion(engine)  # caches the common prefix
        for j, prompt in enumerate(prompts):
            engine.add_request(f"r{j}", prompt, params)
        return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}

    plain = run()
    taken = _force_cascade(monkeypatch)
    assert run() == plain
    assert any(taken)


def test_engine_random_workload_with_the_cascade_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared system prompts, forks (n = 2), multi-turn and a churning pool, as in test_engine."""
    plain_tokens, _ = run_workload(caching=True, seed=1)
    taken = _force_cascade(monkeypatch)
    cascade_tokens, _ = run_workload(caching=True, seed=1)
    assert cascade_tokens == plain_tokens
    assert sum(taken) >= 5, f"cascade taken in {sum(taken)} of {len(taken)} steps"


def _force_cascade(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Drop the default thresholds; record, per build, whether a shared prefix was found."""
    monkeypatch.setattr(attention, "MIN_SHARED_BLOCKS", 1)
    monkeypatch.setattr(attention, "MIN_SAVED_TOKENS", 0)
    taken: list[bool] = []
    build = AttentionMetadata.build.__func__

    def spy(cls: type[AttentionMetadata], *args: Any, **kwargs: Any) -> AttentionMetadata:
        md = build(cls, *args, **kwargs)
        taken.append(bool(md.shared_prefixes))
        return md

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(spy))
    return taken


def test_the_reference_memo_forgets_a_freed_model() -> None:
    """A freed model's logits must go with it: a new model at its address gets its own."""
    other = make_pair(tied=False)
    _reference(other, [1, 2, 3])
    before = len(_REFERENCES)
    del other
    gc.collect()
    assert len(_REFERENCES) == before - 1
