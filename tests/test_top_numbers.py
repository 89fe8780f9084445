"""``prefixcache top``'s numbers: the last minute of its own scrapes (``tools/top/samples.py``,
``numbers.py``), on Prometheus text as a replica writes it."""

from __future__ import annotations

from prefixcache.tools.top.numbers import replica_numbers
from prefixcache.tools.top.samples import Window, parse

PAGE = """\
# TYPE prefixcache_prefix_cache_queries_tokens counter
prefixcache_prefix_cache_queries_tokens_total {queries}
# TYPE prefixcache_prefix_cache_hits_tokens counter
prefixcache_prefix_cache_hits_tokens_total {hits}
# TYPE prefixcache_kv_evictions counter
prefixcache_kv_evictions_total {evictions}
# TYPE prefixcache_kv_blocks gauge
prefixcache_kv_blocks 100.0
# TYPE prefixcache_kv_blocks_by_state gauge
prefixcache_kv_blocks_by_state{{state="running"}} 10.0
prefixcache_kv_blocks_by_state{{state="cached"}} 30.0
prefixcache_kv_blocks_by_state{{state="retained"}} 5.0
prefixcache_kv_blocks_by_state{{state="free"}} 55.0
# TYPE prefixcache_requests counter
prefixcache_requests_total{{endpoint="chat",status="ok",tenant="a"}} {requests}
prefixcache_requests_total{{endpoint="completions",status="ok",tenant="a"}} 1.0
"""


def scrape(at: float, queries: float, hits: float, evictions: float = 0.0, requests: float = 0.0):
    text = PAGE.format(queries=queries, hits=hits, evictions=evictions, requests=requests)
    return parse(text, at)


def test_rates_are_changes_over_the_window_and_since_start_at_first():
    window = Window(span=60.0)
    window.add(scrape(0.0, 100, 50, evictions=4))
    first = replica_numbers(window)
    assert first is not None and first.seconds == 0.0
    assert (first.hit_rate, first.evictions, first.evictions_per_s) == (0.5, 4, None)
    assert first.states == {"running": 10, "cached": 30, "retained": 5, "free": 55}
    window.add(scrape(30.0, 200, 140, evictions=10, requests=3))
    later = replica_numbers(window)
    assert later.seconds == 30.0 and later.hit_rate == 0.9  # 90 of the 100 new tokens
    assert later.evictions_per_s == 0.2
    assert [(t.name, t.requests) for t in later.tenants] == [("a", 3.0)]


def test_the_window_keeps_a_minute_and_starts_again_after_a_restart():
    window = Window(span=60.0)
    for second in range(0, 100, 10):
        window.add(scrape(float(second), 10.0 * second, 5.0 * second))
    assert (
        window.seconds == 60.0
        and window.change("prefixcache_prefix_cache_queries_tokens_total") == 600
    )
    window.add(scrape(100.0, 20, 0))  # the counter went back: a new server process
    assert window.seconds == 0.0
    assert replica_numbers(window).hit_rate == 0.0  # since its start: 0 of 20
    window.add(scrape(101.0, 20, 0))
    assert replica_numbers(window).hit_rate is None  # nothing looked up in the window
