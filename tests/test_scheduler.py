"""The scheduler on a real cache manager, with the model's work left out."""

from __future__ import annotations

import random

from prefixcache import KVCacheManager
from prefixcache.engine.request import Request
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.scheduler import Scheduler


def make_request(name: str, tokens: list[int], **params) -> Request:
    return Request(name, tokens, SamplingParams(temperature=0, **params))


def run_step(scheduler: Scheduler) -> list:
    """Schedule one step and 'decode' one token for every branch that reached its end."""
    chunks = scheduler.schedule()
    for chunk in chunks:
        if chunk.needs_logits:
            chunk.branch.output.token_ids.append(7)
            assert scheduler.manager.append(chunk.branch.seq, [7])
    return chunks


def finish_all(scheduler: Scheduler) -> None:
    for branch in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(branch)
    assert scheduler.manager.num_free_blocks == scheduler.manager.num_blocks
    scheduler.manager.check_invariants()


def test_requests_sent_together_prefill_a_shared_prompt_once():
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(1500)]
    manager = KVCacheManager(num_blocks=2048, block_size=16)
    scheduler = Scheduler(manager, max_num_seqs=64, max_num_batched_tokens=2048)
    for i in range(64):
        tail = [rng.randrange(1000) for _ in range(64)]
        scheduler.add(make_request(f"r{i}", system + tail).branches[0])
    prefill_tokens = 0
    while scheduler.waiting or any(b.seq.num_computed_tokens < 1564 for b in scheduler.running):
        for chunk in run_step(scheduler):
            prefill_tokens += min(chunk.num_tokens, max(0, 1564 - chunk.start))
    # The 93 full blocks of the system prompt once; each request its own 12 + 64 tokens.
    assert prefill_tokens == 1488 + 64 * 76
    finish_all(scheduler)


def test_token_budget_seq_cap_and_chunked_prefill():
    manager = KVCacheManager(num_blocks=1024, block_size=16)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=2048)
    scheduler.add(make_request("long", list(range(5000))).branches[0])
    for i in range(4):
        scheduler.add(make_request(f"s{i}", [9000 + i] * 10).branches[0])
    sizes = [[c.num_tokens for c in run_step(scheduler)] for _ in range(4)]
    assert sizes[0] == [2048]  # the long prompt takes the whole budget
    assert sizes[1] == [2048]
    assert sizes[2] == [904, 10, 10]  # its last chunk, then two more up to the cap of 3
    assert sizes[3] == [1, 1, 1]  # decodes; the 4th short request waits for a seat
    assert all(sum(step) <= 2048 for step in sizes)
    finish_all(scheduler)


def test_cache_aware_order_prefers_cached_prefixes_but_never_starves():
    manager = KVCacheManager(num_blocks=1024, block_size=16)
    shared = list(range(320))
    warm = manager.admit("warm", shared + [1])
    manager.commit(warm, 321)
    manager.free(warm)
    scheduler = Scheduler(
        manager, max_num_seqs=1, max_num_batched_tokens=4096, cache_aware=True, max_passed_over=2
    )
    cold = make_request("cold", list(range(5000, 5100))).branches[0]
    scheduler.add(cold)
    hot = []
    for i in range(4):
        branch = make_request(f"hot{i}", shared + [i, i]).branches[0]
        hot.append(branch)
        scheduler.add(branch)
    admitted = []
    for _ in range(4):
        run_step(scheduler)
        (running,) = scheduler.running
        admitted.append(running.request.request_id)
        scheduler.finish(running)
    assert admitted == ["hot0", "hot1", "cold", "hot2"]  # cold is passed over twice, no more
    finish_all(scheduler)


def test_preemption_frees_the_newest_branch_and_requeues_it_first():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    first, second = (
        make_request(n, list(range(10 * i, 10 * i + 10))).branches[0]
        for i, n in enumerate(["first", "second"])
    )
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    victim = scheduler.preempt_last()
    assert victim is second and second.seq is None and scheduler.waiting[0] is second
    assert manager.num_free_blocks == 8 - len(first.seq.blocks)
    chunks = run_step(scheduler)  # readmitted: prompt + its generated token, 11 tokens
    resumed = next(c for c in chunks if c.branch is second)
    assert (resumed.start, resumed.num_tokens) == (8, 3)  # 2 blocks reused from cache
    assert second.num_preemptions == 1
    finish_all(scheduler)
