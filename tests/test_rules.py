"""One test per cache rule of docs/design.md, named after the rule."""

from __future__ import annotations

from conftest import admit_computed
from prefixcache import MultiModalItem, Namespace
from prefixcache.cache.groups import KVGroupSpec


def test_rule_1_only_complete_blocks_are_cacheable(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    first = admit_computed(m, "a", list(range(10)))  # 2 full blocks + a 2-token tail
    m.free(first)
    assert m.match(list(range(10)) + [77, 78]) == 8  # the tail block was never cached
    assert m.stats.stored_blocks == 2
    again = m.admit("b", list(range(11)))
    assert again.num_cached_tokens == 8
    m.free(again)


def test_rule_2_identity_is_a_chain_of_parent_tokens_and_extras(make_manager):
    m = make_manager(num_blocks=16, block_size=4)
    base = list(range(16))
    m.free(admit_computed(m, "a", base))
    changed = list(base)
    changed[5] = 999  # block 1 changes; blocks 2 and 3 keep their own tokens
    assert m.match(changed + [0]) == 4
    assert m.match(base + [0], cache_salt="s") == 0
    assert m.match(base + [0], lora_name="adapter") == 0
    image = MultiModalItem("image-sha:1", offset=9, length=2)
    m.free(admit_computed(m, "b", base, mm_items=[image]))
    other_image = MultiModalItem("image-sha:2", offset=9, length=2)
    assert m.match(base + [0], mm_items=[image]) == 16
    assert m.match(base + [0], mm_items=[other_image]) == 8  # misses from block 2 on
    left, right = Namespace(model="m", block_size=4), Namespace(model="m2", block_size=4)
    hashes = []
    for namespace in (left, right):
        other = make_manager(num_blocks=4, block_size=4, namespace=namespace)
        seq = other.admit("a", base)
        hashes.append(seq.block_hashes)
        other.free(seq)
    assert all(x != y for x, y in zip(*hashes, strict=True))


def test_rule_3_extra_keys_are_typed_and_length_prefixed(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    salted = admit_computed(m, "a", tokens, cache_salt="x")
    lora = admit_computed(m, "b", tokens, lora_name="x")
    assert salted.block_hashes[0] != lora.block_hashes[0]
    assert m.match(tokens, cache_salt="x") == 8
    assert m.match(tokens, lora_name="x") == 8
    assert m.match(tokens, cache_salt="x", lora_name="x") == 0
    m.free(salted)
    m.free(lora)
    split_a = [MultiModalItem("ab", 0, 1), MultiModalItem("c", 1, 1)]
    split_b = [MultiModalItem("a", 0, 1), MultiModalItem("bc", 1, 1)]
    seq = admit_computed(m, "c", tokens, mm_items=split_a)
    assert m.match(tokens, mm_items=split_b) == 0
    m.free(seq)


def test_rule_4_lookup_walks_block_by_block_and_stops_at_first_miss(make_manager):
    m = make_manager(num_blocks=16, block_size=4)
    tokens = list(range(20))
    m.free(admit_computed(m, "a", tokens))
    for first_miss in range(5):
        probe = list(tokens)
        probe[first_miss * 4] = 1000  # break block `first_miss` only
        assert m.match(probe + [1]) == first_miss * 4
        seq = m.admit(f"p{first_miss}", probe + [1])
        assert seq.num_cached_tokens == first_miss * 4
        m.free(seq)


def test_rule_5_touch_before_allocate_and_capacity_first(make_manager):
    m = make_manager(num_blocks=4, block_size=4)
    prefix = list(range(8))
    a = admit_computed(m, "a", prefix)  # blocks 0, 1
    c = admit_computed(m, "c", list(range(100, 108)))  # blocks 2, 3
    a_table = list(a.block_table)
    m.free(a)  # queue head: a's blocks, the very prefix the next request will hit
    order_before = [b.block_id for b in m.pool.free_blocks()]
    stats_before = m.stats.as_dict()
    assert m.admit("too-big", prefix + [1, 2, 3, 4, 5]) is None  # needs 2 new, 0 spare
    assert [b.block_id for b in m.pool.free_blocks()] == order_before
    assert {k: v for k, v in m.stats.as_dict().items() if k != "failed_admissions"} == {
        k: v for k, v in stats_before.items() if k != "failed_admissions"
    }
    m.free(c)  # now c's blocks sit behind a's in the queue
    b = m.admit("b", prefix + [9])  # hits a's 2 blocks, needs 1 new
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a_table
    assert b.block_table[2] in (2, 3)  # taken from c's blocks, not from its own prefix
    m.free(b)


def test_rule_6_refcounted_blocks_never_evicted_and_shared_blocks_immutable(make_manager):
    m = make_manager(num_blocks=6, block_size=4)
    live = admit_computed(m, "live", list(range(10)))  # 3 blocks, last one partial
    for i in range(20):  # pressure: every other admission must fail, never evict
        other = m.admit(f"o{i}", list(range(50 + i, 62 + i)))
        if other is not None:
            m.commit(other, other.num_tokens)
            m.free(other)
    assert m.match(list(range(10))) == 8
    assert all(block.ref_cnt == 1 for block in live.blocks)
    child = m.fork(live, "live/1")
    shared_tail = live.block_table[-1]
    assert m.append(child, [7])
    (copy,) = m.pop_pending_copies()
    assert copy[0] == shared_tail and copy[1] == child.block_table[-1] != shared_tail
    assert live.block_table[-1] == shared_tail  # the parent's block was not written
    assert m.append(live, [8])  # now private: written in place, no copy
    assert m.pop_pending_copies() == []
    m.free(child)
    m.free(live)


def test_rule_7_free_in_reverse_order_and_eviction_clears_the_hash(make_manager):
    m = make_manager(num_blocks=4, block_size=2)
    seq = admit_computed(m, "a", list(range(8)))  # 4 full blocks, all stored
    table = list(seq.block_table)
    m.free(seq)
    assert [b.block_id for b in m.pool.free_blocks()] == table[::-1]  # deepest first
    deepest = m.pool.blocks[table[-1]]
    key = deepest.key
    assert key in m.pool.cached
    fresh = m.admit("b", [500, 501])  # takes the head: the deepest block
    assert fresh.block_table == [table[-1]]
    assert key not in m.pool.cached
    assert (deepest.key, deepest.uid, deepest.digest) == (None, 0, None)
    assert m.stats.evictions == 1
    assert m.match(list(range(8)) + [0]) == 6  # the shallow prefix survived
    m.free(fresh)


def test_rule_8_duplicates_allowed_stale_mappings_never(make_manager):
    m = make_manager(num_blocks=6, block_size=4)
    tokens = list(range(9))
    one = m.admit("one", tokens)
    two = m.admit("two", tokens)  # submitted together: both compute the same prefix
    m.commit(one, 9)
    m.commit(two, 9)
    assert m.stats.duplicate_blocks == 2 and m.stats.stored_blocks == 2
    assert one.block_hashes == two.block_hashes
    m.check_invariants()
    m.free(one)
    m.free(two)
    for i in range(6):  # churn until every slot has been reused
        other = admit_computed(m, f"x{i}", [1000 + i] * 8 + [i])
        m.free(other)
        m.check_invariants()
    for key, block in m.pool.cached.items():
        assert block.key == key
    assert m.match(tokens) == 0


def test_rule_9_blocks_become_matchable_only_once_committed(make_manager):
    m = make_manager(num_blocks=6, block_size=4)
    tokens = list(range(13))
    seq = m.admit("a", tokens)
    assert m.match(tokens) == 0
    m.commit(seq, 6)  # block 0 computed, block 1 half computed
    assert m.match(tokens) == 4
    m.commit(seq, 13)
    assert m.match(tokens) == 12
    m.free(seq)


def test_rule_10_last_prompt_token_is_always_computed(make_manager):
    m = make_manager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    m.free(admit_computed(m, "a", tokens))
    assert m.match(tokens) == 4  # 8 cached, but the 8th token must be recomputed
    again = m.admit("b", tokens)
    assert again.num_cached_tokens == 4 and again.num_computed_tokens == 4
    m.free(again)
    assert m.match(tokens + [8]) == 8


def test_rule_11_a_window_reads_only_held_pages_and_a_hit_serves_every_group(make_manager):
    groups = [KVGroupSpec(1), KVGroupSpec(1, 8)]  # a window of 8 tokens reads 2 whole blocks
    m = make_manager(num_blocks=16, block_size=4, groups=groups)
    tokens = list(range(24))
    seq = admit_computed(m, "a", tokens)
    assert seq.window_tables[0][:4] == [-1] * 4  # out of the window: given back at once
    assert m.stats.window_pages_released == 4
    m.free(seq)
    assert m.match(tokens + [99]) == 24  # the window at the prompt's end was kept
    assert m.match(tokens[:12] + [99]) == 12  # stale pages still serve until evicted
    for request_id, offset in (("d", 100), ("e", 200)):  # pressure: stale pages go first
        m.free(admit_computed(m, request_id, list(range(offset, offset + 8))))
    assert m.stats.window_pages_evicted >= 4
    assert m.match(tokens[:12] + [99]) == 0  # full blocks held, windows not: a miss
    assert m.match(tokens + [99]) == 24  # the kept window outlived the stale ones
