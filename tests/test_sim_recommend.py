"""``simulate --recommend``: the ladder, the safety rule, the pick and its margin."""

from __future__ import annotations

import argparse

from prefixcache.sim.cli import add_simulate_parser, run_simulate
from prefixcache.sim.recommend import format_recommendation, ladder, recommend
from prefixcache.sim.replay import ReplayResult
from prefixcache.sim.sweep import Optimum, SweepReport
from prefixcache.sim.synth import family_config, synth_trace, write_trace


def fake_report(hits: dict[str, list[int]], capacities: list[int]) -> SweepReport:
    """A sweep whose policies served ``hits[policy][i]`` of 1,000 blocks at capacity i."""
    report = SweepReport({})
    for i, capacity in enumerate(capacities):
        for policy, served in hits.items():
            run = ReplayResult(capacity, policy, "hash", blocks=1000, hit_blocks=served[i])
            report.results.append(run)
        report.optimum.append(Optimum(capacity, 900, 0.9, 0.0))
    return report


def test_the_ladder_spans_a_quarter_to_four_times_and_stays_feasible():
    assert ladder(1000, 1) == [250, 500, 1000, 2000, 4000]
    assert ladder(100, 60) == [60, 100, 200, 400]


def test_a_policy_below_lru_anywhere_is_not_recommended():
    capacities = [250, 500, 1000]
    report = fake_report(
        {"lru": [100, 200, 300], "arc": [90, 260, 400], "slru": [110, 220, 350]}, capacities
    )
    pick = recommend(report, 1000)
    assert pick.policy == "slru" and pick.unsafe == {"arc": 250}
    assert round(pick.margin, 2) == 5.0 and round(pick.gap_closed, 2) == round(50 / 600, 2)
    assert (round(pick.worst_margin, 2), pick.worst_at) == (1.0, 250)


def test_lru_stays_when_no_other_policy_is_safe_or_better():
    report = fake_report({"lru": [100, 200], "arc": [99, 300], "slru": [100, 200]}, [1, 2])
    assert recommend(report, 2).policy == "lru"  # slru only ties


def test_simulate_recommend_prints_the_pick(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(synth_trace(family_config("chat", conversations=120)), path)
    parser = argparse.ArgumentParser(prog="prefixcache")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", str(path), "--capacity", "400", "--recommend", "--quiet"])
    assert run_simulate(args) == 0
    out = capsys.readouterr().out
    assert "capacity       lru       arc      slru     lfuda   signals   learned   optimum" in out
    assert "recommended eviction policy at 400 blocks:" in out
    assert "lru is the honest answer: signals leads by +1.09 points (95% interval" in out
    assert "over 20 slices of the trace), which reaches zero" in out


def per_request_report(leads: list[int]) -> SweepReport:
    """One capacity; slru serves ``leads[i]`` more blocks than lru on request i."""
    report = SweepReport({})
    lru = ReplayResult(1, "lru", "hash", blocks=1000, hit_blocks=100)
    lru.hits_per_request = [5] * len(leads)
    slru = ReplayResult(1, "slru", "hash", blocks=1000, hit_blocks=100 + sum(leads))
    slru.hits_per_request = [5 + lead for lead in leads]
    report.results += [lru, slru]
    report.optimum.append(Optimum(1, 900, 0.9, 0.0))
    return report


def test_a_steady_lead_is_recommended_with_its_interval():
    pick = recommend(per_request_report([1, 1, 2, 2] * 10), 1)
    assert pick.policy == "slru" and pick.contender is None
    assert pick.lead.slices == 20 and round(pick.lead.points, 2) == 6.0
    assert 0 < pick.lead.low < 6.0 < pick.lead.high
    text = format_recommendation(pick, [1])
    assert "confidence: lead +6.00 points (95% interval +" in text


def test_a_lead_made_of_a_few_lucky_requests_leaves_lru_the_honest_answer():
    leads = [0] * 39 + [8]  # one slice gains, the others tie
    pick = recommend(per_request_report(leads), 1)
    assert (pick.policy, pick.contender) == ("lru", "slru")
    assert pick.lead.low <= 0 < pick.lead.points
    text = format_recommendation(pick, [1])
    assert "lru is the honest answer: slru leads by +0.80 points" in text
    assert "use it:" not in text
