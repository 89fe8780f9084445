"""Shared fixtures: every manager a test makes must end full and consistent."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from prefixcache import KVCacheManager

# The Mooncake trace, kept in the repo (data/README.md says where it comes from).
REAL_TRACE = Path(__file__).resolve().parents[1] / "data/mooncake_synthetic_trace.jsonl"

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# One torch thread per test process (an OMP_NUM_THREADS already set wins), and for the
# processes the tests start. The suite's models are tiny or serve one request at a time: a
# second intra-op thread buys them little, and while anything else runs on the machine, the
# OpenMP threads spinning for their turn make every op several times slower (measured on 2
# cores beside other jobs: the real-model files 170 s with 2 threads, 49 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The servers the tests start keep the default model's built weights in the repo's own
# .cache (ignored by git), not in the user's home: one build per clone, shared by workers.
os.environ.setdefault(
    "PREFIXCACHE_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache/weight-cache")
)
if "torch" in sys.modules:  # imported before this file: too late for the variable
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module")
def native() -> None:
    """The native kernels must load here (the machine has a compiler)."""
    from prefixcache.engine import kernels

    assert kernels.available(), "the native kernels did not build (see the log)"


@pytest.fixture
def make_manager() -> Iterator[Callable[..., KVCacheManager]]:
    """Factory for managers; at teardown each must be full again and pass its checks."""
    made: list[KVCacheManager] = []

    def factory(*args: object, **kwargs: object) -> KVCacheManager:
        manager = KVCacheManager(*args, **kwargs)
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        assert not manager.sequences, f"test left live sequences: {list(manager.sequences)}"
        assert manager.num_free_blocks == manager.num_blocks, "test leaked blocks"
        manager.check_invariants()


def admit_computed(manager: KVCacheManager, request_id: str, tokens: list[int], **kw):
    """Admit a request and mark its whole prompt computed, as an engine would."""
    seq = manager.admit(request_id, tokens, **kw)
    assert seq is not None, f"{request_id} did not fit"
    manager.commit(seq, len(tokens))
    return seq


def pool_holdings(manager: KVCacheManager) -> set[tuple[bytes, int]]:
    """What the pool can match, as KV events describe it: (digest, group_idx) of every indexed
    block (group 0) and of each page an indexed block has attached in window group g (g + 1)."""
    pool = manager.pool
    held = {(block.digest, 0) for block in pool.cached.values()}
    windows = manager.windows
    for block_id, pages in {} if windows is None else windows.attached.items():
        logical = pool.blocks[block_id]
        if logical.key is not None:
            held |= {(logical.digest, g + 1) for g, page in enumerate(pages) if page is not None}
    return held


# The inner loop's subset (`make test-quick`): the cache core, the protocol, the simulator, the
# tier's codec and stores, and the small-engine tests; no real model, no subprocess server,
# cluster, fuzzer or soak, and not the long property runs (state machines, radix and event
# differentials). `make test` (CI) runs everything, these included.
QUICK_FILES = frozenset(
    {
        "test_block_pool.py", "test_cache_chains.py", "test_explain.py", "test_fair_admission.py",
        "test_fair_cache.py", "test_hashing.py", "test_kv_events.py", "test_lab.py",
        "test_manager.py", "test_retention.py", "test_router_index.py",
        "test_router_policy.py", "test_rule_citations.py", "test_rules.py", "test_sampling.py",
        "test_scheduler.py", "test_sim_cluster.py", "test_sim_fairness.py",
        "test_sim_recommend.py", "test_sim_replay.py", "test_sim_traces.py",
        "test_synth_trace.py", "test_tier_client.py", "test_tier_codec.py", "test_tier_disk.py",
        "test_tier_disk_hostile.py", "test_tier_redis.py", "test_engine.py", "test_top_numbers.py",
    }
)  # fmt: skip


# `make test` runs whole files on two pytest-xdist workers (--dist loadfile, GROUPS of files
# as one), in collection order (--no-loadscope-reorder). These files take
# longest (measured under xdist, longest first): they start first, so the run does not end
# with one worker alone on a long file.
SLOW_FILES = (
    "test_ray_serve.py", "test_gemma3.py", "test_gguf_tokenizers.py", "test_weight_types.py",
    "test_chat_templates.py", "test_stop_signals.py", "test_ray_stop.py", "test_stateful.py",
    "test_router.py", "test_cluster_command.py", "test_router_key_affinity.py",
    "test_router_apis.py", "test_tools_default_model.py",
    "test_cache_events.py", "test_kv_events_serve.py", "test_policy.py",
    "test_router_hardening.py", "test_weights.py", "test_quantized.py", "test_audit.py",
    "test_access_log.py", "test_messages_tools_default_model.py", "test_prepare_process.py",
    "test_openai_cache_controls.py", "test_fuzz_api.py", "test_server_hardening.py", "test_top.py",
    "test_prometheus_rules.py",
)  # fmt: skip

# Files that share one worker: the real Gemma 3 file's gguf-py parse (~8 s), our tokenizer of
# it (~4 s) and transformers' are cached per process (gemma_fixtures.py, hf_fixtures.py).
GROUPS = dict.fromkeys(
    (
        "test_gemma3.py",
        "test_gguf_tokenizers.py",
        "test_weight_types.py",
        "test_chat_templates.py",
        "test_sim_windows.py",
    ),
    "gemma-file",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadfile, with each of ``GROUPS`` one unit of work (xdist's own loadgroup sets
    a node id attribute pytest 9 no longer reads)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return GROUPS.get(Path(file).name, file)

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of ``QUICK_FILES`` ``quick`` (the list lives here, in one place); under
    xdist, move ``SLOW_FILES`` to the front (a stable sort: the rest keep their order)."""
    for item in items:
        if item.path.name in QUICK_FILES:
            item.add_marker(pytest.mark.quick)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: place for place, name in enumerate(SLOW_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
