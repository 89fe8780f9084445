"""The intrusive free queue against a plain list model, and the pool's eviction."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.blocks import Block, FreeBlockQueue
from prefixcache.cache.observer import KeyLogObserver
from prefixcache.cache.stats import CacheStats

OPS = st.lists(
    st.tuples(st.sampled_from(["pop", "remove", "append", "appendleft"]), st.integers(0, 15)),
    max_size=80,
)


@given(OPS)
def test_free_queue_matches_a_list_model(ops):
    blocks = [Block(i) for i in range(16)]
    queue = FreeBlockQueue(blocks)
    model = list(range(16))
    for op, index in ops:
        block = blocks[index]
        if op == "pop" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "remove" and index in model:
            queue.remove(block)
            model.remove(index)
        elif op == "append" and index not in model:
            queue.append(block)
            model.append(index)
        elif op == "appendleft" and index not in model:
            queue.appendleft(block)
            model.insert(0, index)
        assert [b.block_id for b in queue] == model
        assert len(queue) == len(model)


@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_release_puts_cached_blocks_at_the_tail_in_order_and_empty_ones_first(cached_flags):
    pool = BlockPool(len(cached_flags) + 2, CacheStats())
    taken = pool.allocate(len(cached_flags))
    for block, cached in zip(taken, cached_flags, strict=True):
        if cached:
            pool.store(block, (0, bytes([block.block_id])), b"d")
    pool.release(reversed(taken))
    order = [b.block_id for b in pool.free_blocks()]
    empties = [b.block_id for b in taken if b.key is None]
    cached_ids = [b.block_id for b in reversed(taken) if b.key is not None]
    assert sorted(order[: len(empties)]) == sorted(empties)
    assert order[len(empties) : len(empties) + 2] == [len(cached_flags), len(cached_flags) + 1]
    assert order[len(empties) + 2 :] == cached_ids
    assert pool.num_free_blocks == len(cached_flags) + 2


def test_touch_takes_free_hits_out_of_the_queue_and_counts_shared_ones():
    pool = BlockPool(4, CacheStats())
    a, b = pool.allocate(2)
    pool.store(a, (0, b"a"), b"d")  # hits are cached blocks: free ones wait in the policy
    pool.release([a])
    assert [x.block_id for x in pool.free_blocks()] == [2, 3, 0]
    pool.touch([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    assert [x.block_id for x in pool.free_blocks()] == [2, 3]
    assert pool.num_free_blocks == 2


def test_listeners_are_explicit_lists_and_no_method_is_rebound(make_manager):
    m = make_manager(8, 2)
    m.set_observer(KeyLogObserver(lambda line: None, m.root_digest))
    sink: list = []
    m.set_event_sink(sink.append)
    pool = m.pool
    assert len(pool.on_index) == 1 and len(pool.on_evict) == 2 and len(pool.on_clear) == 1
    shadowed = [name for name in vars(pool) if callable(getattr(type(pool), name, None))]
    assert shadowed == []  # no hook replaced a method on the instance
    m.set_event_sink(None)  # the removal reporter leaves; the key log stays
    assert pool.on_index == [] and len(pool.on_evict) == 1 and pool.on_clear == []
    m.free(m.admit("a", [1, 2, 3]))
    m.check_invariants()
