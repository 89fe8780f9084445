"""The KVCacheManager API: results, refusals that change nothing, and clear errors."""

from __future__ import annotations

import pytest

from conftest import admit_computed
from prefixcache import CapacityError, KVCacheManager, MultiModalItem


def pool_state(m: KVCacheManager) -> tuple:
    """Everything an admission must leave untouched when it fails."""
    return (
        [b.block_id for b in m.pool.free_blocks()],
        [(b.ref_cnt, b.key, b.uid) for b in m.pool.blocks],
        dict(m.pool.cached),
    )


def test_admit_returns_none_and_changes_nothing_when_full(make_manager):
    m = make_manager(num_blocks=4, block_size=4)
    held = admit_computed(m, "held", list(range(12)))
    before = pool_state(m)
    assert m.admit("r", list(range(50, 58))) is None
    assert pool_state(m) == before
    assert m.stats.failed_admissions == 1 and m.stats.requests == 1
    assert "r" not in m.sequences
    m.free(held)


def test_prompt_larger_than_the_pool_is_a_capacity_error_with_both_numbers(make_manager):
    m = make_manager(num_blocks=4, block_size=4)
    with pytest.raises(
        CapacityError, match=r"17 tokens and needs 5 KV blocks; the pool has 4 blocks \(16"
    ):
        m.admit("r", list(range(17)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": []}, "token_ids is empty"),
        ({"token_ids": "hello"}, "must be a list of ints, got str"),
        ({"token_ids": [1, None]}, r"token_ids\[1\] is NoneType"),
        ({"token_ids": [1], "cache_salt": 5}, "cache_salt must be a string or None, got int"),
        ({"token_ids": [1], "lora_name": b"x"}, "lora_name must be a string or None"),
        (
            {"token_ids": [1, 2], "mm_items": [MultiModalItem("i", 1, 5)]},
            r"mm_items\[0\] covers \[1, 6\), outside the prompt's 2 tokens",
        ),
    ],
)
def test_bad_requests_get_clear_errors_and_change_nothing(make_manager, kwargs, message):
    m = make_manager(num_blocks=4, block_size=4)
    before = pool_state(m)
    with pytest.raises(ValueError, match=message):
        m.admit("r", **kwargs)
    assert pool_state(m) == before


def test_lifecycle_misuse_is_refused(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    seq = m.admit("r", [1, 2, 3])
    with pytest.raises(ValueError, match="already admitted"):
        m.admit("r", [1])
    with pytest.raises(ValueError, match="already admitted"):
        m.fork(seq, "r")
    with pytest.raises(ValueError, match="commit of 4 tokens; the sequence has 3"):
        m.commit(seq, 4)
    with pytest.raises(ValueError, match=r"token_ids\[0\] = -3"):
        m.append(seq, [-3])
    assert seq.token_ids == [1, 2, 3]
    m.free(seq)
    with pytest.raises(ValueError, match="not live"):
        m.free(seq)
    with pytest.raises(ValueError, match="not live"):
        m.append(seq, [1])
    other = KVCacheManager(4, 4)
    foreign = other.admit("f", [1])
    with pytest.raises(ValueError, match="not live in this manager"):
        m.commit(foreign, 1)
    other.free(foreign)


def test_append_grows_the_table_and_refuses_without_change_when_full(make_manager):
    m = make_manager(num_blocks=3, block_size=4)
    seq = m.admit("r", [1, 2, 3])
    assert m.append(seq, [4]) and seq.block_table == [seq.block_table[0]]
    assert m.append(seq, [5, 6, 7, 8, 9]) and len(seq.block_table) == 3
    before = (list(seq.block_table), list(seq.token_ids), m.num_free_blocks)
    assert not m.append(seq, [1, 2, 3, 4])  # 13 tokens need a 4th block
    assert (seq.block_table, seq.token_ids, m.num_free_blocks) == before
    assert m.append(seq, [10, 11, 12])  # fills the last block exactly
    m.free(seq)


def test_generated_blocks_become_matchable_once_committed(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    seq = admit_computed(m, "r", [1, 2, 3, 4, 5, 6])
    m.append(seq, [7, 8, 9])
    m.commit(seq, 9)
    m.free(seq)
    assert m.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    follow_up = m.admit("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert follow_up.num_cached_tokens == 8
    m.free(follow_up)


def test_fork_shares_blocks_and_counts_references(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    seq = admit_computed(m, "r", list(range(6)))
    child = m.fork(seq, "r/1")
    assert child.block_table == seq.block_table
    assert all(block.ref_cnt == 2 for block in seq.blocks)
    assert child.num_computed_tokens == 6 and child.token_ids == seq.token_ids
    assert child.token_ids is not seq.token_ids
    m.free(seq)
    assert all(block.ref_cnt == 1 for block in child.blocks)
    m.free(child)


def test_match_has_no_side_effects(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    m.free(admit_computed(m, "r", list(range(12))))
    before, stats = pool_state(m), m.stats.as_dict()
    assert m.match(list(range(13))) == 12
    assert pool_state(m) == before and m.stats.as_dict() == stats


def test_reset_refuses_while_in_use_and_then_drops_everything(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    seq = admit_computed(m, "r", list(range(12)))
    assert m.reset() is False
    assert m.match(list(range(13))) == 12
    m.free(seq)
    assert m.reset() is True
    assert m.match(list(range(13))) == 0 and not m.pool.cached
    again = m.admit("again", list(range(13)))
    assert again.num_cached_tokens == 0  # the path memo was dropped too
    m.free(again)
    assert m.stats.resets == 1


def test_stats_usage_and_watermark(make_manager):
    m = make_manager(num_blocks=10, block_size=4)
    first = admit_computed(m, "a", list(range(9)))
    assert m.usage == pytest.approx(0.3)
    m.free(first)
    second = m.admit("b", list(range(9)))
    assert (m.stats.queries, m.stats.hits, m.stats.requests) == (18, 8, 2)
    assert m.stats.hit_rate == pytest.approx(8 / 18)
    assert m.stats.min_free_blocks == 7
    m.free(second)


def test_caching_off_never_hits_and_stores_nothing(make_manager):
    m = make_manager(num_blocks=8, block_size=4, enable_caching=False)
    m.free(admit_computed(m, "a", list(range(12))))
    second = admit_computed(m, "b", list(range(12)))
    assert second.num_cached_tokens == 0 and not m.pool.cached
    assert m.match(list(range(12))) == 0
    assert len(second.block_hashes) == 3  # digests stay available for logs and events
    m.free(second)


def test_path_memo_is_separate_per_salt(make_manager):
    m = make_manager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    m.free(admit_computed(m, "a", prompt, cache_salt="tenant-a"))
    hit = m.admit("a2", prompt, cache_salt="tenant-a")  # recalled from the memo
    other = m.admit("b", prompt, cache_salt="tenant-b")
    plain = m.admit("c", prompt)
    assert (hit.num_cached_tokens, other.num_cached_tokens, plain.num_cached_tokens) == (12, 0, 0)
    for seq in (hit, other, plain):
        m.free(seq)


def test_path_memo_stops_at_an_evicted_block(make_manager):
    m = make_manager(num_blocks=6, block_size=4)
    prompt = list(range(17))  # 4 full blocks + 1
    m.free(admit_computed(m, "a", prompt))
    m.free(m.admit("warm", prompt))  # the memo now remembers all 4 blocks
    filler = m.admit("filler", [900, 901])  # takes the queue head: an uncached block
    filler2 = m.admit("filler2", list(range(500, 508)))  # evicts the deepest cached block
    assert m.match(prompt) == 12
    # The memo still lists 4 blocks; the recall must stop at the evicted one, leaving
    # 3 hits that are themselves the only free blocks: the admission cannot fit.
    assert m.admit("again", prompt) is None
    m.free(filler)
    m.free(filler2)
    probe = m.admit("probe", prompt)
    assert probe.num_cached_tokens == 12 == m.match(prompt)
    m.free(probe)
