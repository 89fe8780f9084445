"""Window groups in the cache core: the longest hit across groups, recompute only what the
windows lack, no churn from recomputed windows, and copy-on-write of window pages."""

from __future__ import annotations

import pytest

from conftest import admit_computed
from prefixcache import CapacityError
from prefixcache.cache.groups import KVGroupSpec, window_sizes

WINDOW = [KVGroupSpec(1), KVGroupSpec(1, 8)]  # block size 4: a hit needs 2 window pages


def _evict_stale(m, count: int) -> None:
    """Fill the empty queue's blocks, then take ``count`` more pages: stale ones go first."""
    filler = [admit_computed(m, f"f{i}", list(range(1000 + 8 * i, 1008 + 8 * i)))
              for i in range(count)]  # fmt: skip
    for seq in filler:
        m.free(seq)


def test_a_window_caused_miss_recomputes_from_the_longest_hit_not_from_zero(make_manager):
    m = make_manager(num_blocks=16, block_size=4, groups=WINDOW)
    tokens = list(range(24))
    first = m.admit("a", tokens)
    m.commit(first, 16)  # blocks 0 and 1 leave the window
    m.commit(first, 24)  # blocks 2 and 3 too; 4 and 5 are the prompt's end
    m.free(first)
    _evict_stale(m, 2)
    assert m.stats.window_pages_evicted >= 4
    follow = m.admit("b", tokens + [7] * 5)
    assert follow.num_cached_tokens == 24  # the full hit, served whole: its window was kept
    m.free(follow)
    half = m.admit("c", tokens[:20] + [9])  # full hit 5 blocks: window pages 3, 4 needed
    assert half.num_cached_tokens == 0  # block 3's page was stale and is gone
    assert m.stats.window_lost_tokens == 20
    m.free(half)


def test_recomputed_windows_are_adopted_so_the_next_request_hits(make_manager):
    m = make_manager(num_blocks=16, block_size=4, groups=WINDOW)
    tokens = list(range(24))
    m.free(admit_computed(m, "a", tokens))
    _evict_stale(m, 2)
    probe = tokens[:12] + [99]
    assert m.match(probe) == 0  # full blocks 0-2 cached, their window pages evicted
    m.free(admit_computed(m, "b", probe))  # recomputes blocks 0-2 as duplicates
    assert m.match(probe) == 12  # their window pages went to the indexed copies: no churn


def test_fork_copies_the_shared_partial_block_in_every_group(make_manager):
    m = make_manager(num_blocks=24, block_size=4, groups=WINDOW)
    parent = admit_computed(m, "a", list(range(10)))
    child = m.fork(parent, "b")
    assert m.append(child, [5])
    copies = dict(m.pop_pending_copies())
    assert copies[parent.block_table[-1]] == child.block_table[-1]
    assert copies[parent.window_tables[0][-1]] == child.window_tables[0][-1]
    assert child.window_tables[0][:-1] == parent.window_tables[0][:-1]
    m.free(parent)
    m.free(child)


def test_capacity_counts_every_groups_pages(make_manager):
    m = make_manager(num_blocks=8, block_size=4, groups=WINDOW)
    with pytest.raises(CapacityError, match=r"needs 10 KV blocks \(2 pages a block"):
        m.admit("a", list(range(20)))  # 5 blocks x 2 pages > 8


@pytest.mark.parametrize(
    ("groups", "problem"),
    [
        ([KVGroupSpec(2, 8), KVGroupSpec(2)], "first KV group must be full"),
        ([KVGroupSpec(2), KVGroupSpec(2)], "only the first KV group may be full"),
        ([KVGroupSpec(2), KVGroupSpec(3, 8)], "equal layer counts"),
    ],
)
def test_groups_a_pool_cannot_serve_are_refused_by_name(groups, problem):
    with pytest.raises(ValueError, match=problem):
        window_sizes(groups)
