"""``prefixcache audit-timing``: can a client tell a cached prefix from a fresh one by TTFT?

Against a running server. Each trial sends a random prefix from a *primer* key (so the
server caches it), then, in random order, two streamed probes from a *probe* key: the
same prefix with a new question, and a fresh random prefix of the same length. Time to
first token of each probe is measured client-side. The ROC AUC of a threshold classifier
("faster means cached") says how well timing separates them: 0.5 is no signal, 1.0 a
perfect oracle. Scenarios: within one tenant (a signal is expected: the price of
sharing), across two tenants, and a no-reuse tenant (both must sit near 0.5).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass

_WORD_TEXT = (
    "apple river stone cloud garden window paper silver horse market bridge candle forest "
    "island engine letter mirror number orange pepper rocket shadow temple valley winter "
    "yellow anchor basket castle dragon feather guitar hammer jacket kettle ladder magnet "
    "needle pillow rabbit saddle ticket violin wagon bottle carpet dinner finger harbor "
    "lemon mountain planet summer tunnel circle doctor farmer jungle monkey pocket silence"
)
WORDS = tuple(_WORD_TEXT.split())
LEAK_SDS = 3.0  # across an isolating boundary: an AUC this far above 0.5 is a leak
SIGNAL_SDS = 2.0  # within a tenant, where a signal is expected: enough to confirm it


class AuditError(Exception):
    """The server could not be audited (unreachable, or an HTTP error)."""


@dataclass(slots=True)
class Scenario:
    """Who caches the prefix (primer) and who probes for it."""

    name: str
    primer_key: str | None
    probe_key: str | None
    shared: bool  # whether the cache is meant to be shared between primer and probe


@dataclass(slots=True)
class ScenarioResult:
    """TTFT samples (seconds) of the probes whose prefix was primed, and of fresh ones."""

    scenario: Scenario
    cached: list[float]
    fresh: list[float]

    @property
    def auc(self) -> float:
        return roc_auc(self.cached, self.fresh)

    @property
    def sd(self) -> float:
        return null_sd(len(self.cached), len(self.fresh))

    def above_noise(self, sds: float) -> bool:
        """Whether the AUC is more than ``sds`` null standard deviations above 0.5."""
        return self.auc > 0.5 + sds * self.sd


def roc_auc(positives: list[float], negatives: list[float]) -> float:
    """P(a positive is faster than a negative), ties counting half: the Mann-Whitney AUC."""
    wins = sum((p < n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def null_sd(n_positive: int, n_negative: int) -> float:
    """Standard deviation of the AUC when timing carries no signal."""
    return math.sqrt((n_positive + n_negative + 1) / (12 * n_positive * n_negative))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def scenarios(keys: list[str], no_reuse_key: str | None) -> list[Scenario]:
    """Within one tenant always; across tenants with two keys; no-reuse with its key."""
    first = keys[0] if keys else None
    found = [Scenario("within one tenant", first, first, True)]
    if len(keys) >= 2:
        found.append(Scenario("across tenants", keys[0], keys[1], False))
    if no_reuse_key:
        found.append(Scenario("no-reuse tenant", no_reuse_key, no_reuse_key, False))
    return found


def random_text(rng: random.Random, num_words: int) -> str:
    """A random run of common words (about one token each)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def run_scenario(client, scenario: Scenario, trials: int, words: int, rng) -> ScenarioResult:
    """``trials`` rounds of: prime a prefix, then time the primed and a fresh probe."""
    result = ScenarioResult(scenario, [], [])
    for _ in range(trials):
        prefix, fresh = random_text(rng, words), random_text(rng, words)
        client.prime(scenario.primer_key, f"{prefix}. First question: what comes next?")
        probes = [(result.cached, prefix), (result.fresh, fresh)]
        rng.shuffle(probes)  # neither probe always goes first
        for samples, text in probes:
            samples.append(client.ttft(scenario.probe_key, f"{text}. Second question: why?"))
    return result


def audit(
    client, found: list[Scenario], trials: int, words: int, seed: int
) -> tuple[int, list[ScenarioResult]]:
    """Warm the server up, then run every scenario: (prompt tokens, results)."""
    rng = random.Random(seed)
    key = found[0].probe_key
    client.discover_model(key)
    usage = client.prime(key, random_text(rng, words))
    for _ in range(2):
        client.ttft(key, random_text(rng, words))
    results = [run_scenario(client, scenario, trials, words, rng) for scenario in found]
    return usage["prompt_tokens"], results


def report(url: str, model: str, prompt_tokens: int, results: list[ScenarioResult]) -> list[str]:
    """The distributions, the AUCs, and what they mean, in words."""
    trials = len(results[0].cached)
    lines = [
        f"audit-timing: {url}, model {model!r}, {trials} trials per scenario, prompts of "
        f"~{prompt_tokens} tokens, max_tokens 1",
        f"{'TTFT (ms)':<20}{'probe':<8}{'median':>8}{'p10':>8}{'p90':>8}{'ROC AUC':>9}",
    ]
    for result in results:
        for label, samples in (("cached", result.cached), ("fresh", result.fresh)):
            name = result.scenario.name if label == "cached" else ""
            auc = f"{result.auc:9.2f}" if label == "fresh" else ""
            stats = [percentile(samples, q) * 1000 for q in (50, 10, 90)]
            lines.append(f"{name:<20}{label:<8}" + "".join(f"{v:8.1f}" for v in stats) + auc)
    return lines + [verdict(result) for result in results]


def verdict(result: ScenarioResult) -> str:
    """One sentence per scenario: a signal, or noise; and what a signal within a tenant costs."""
    sd = result.sd
    head = f"{result.scenario.name}: AUC {result.auc:.2f}"
    if result.scenario.shared:
        if not result.above_noise(SIGNAL_SDS):
            return f"{head}: no hit/miss signal (is caching on, and the prefix long enough?)"
        return (
            f"{head}: a client holding this tenant's key can tell a prefix its tenant just "
            "sent from a fresh one. That is the price of sharing the cache within a tenant: "
            "users who must not learn about each other's prompts need separate tenants "
            "(or no_reuse, or min_shared_tokens against prefix-by-prefix probing)."
        )
    if 0.5 + LEAK_SDS * sd >= 1.0:
        return f"{head}: too few trials to tell a leak from noise (use --trials 10 or more)"
    if result.above_noise(LEAK_SDS):
        return f"{head}: LEAK: timing tells cached from fresh (noise is +-{sd:.2f} at 1 sd)"
    return f"{head}: within noise of 0.5 (+-{sd:.2f} at 1 sd): no signal crosses this boundary"


def has_leak(results: list[ScenarioResult]) -> bool:
    """Whether a boundary that should isolate shows a signal."""
    return any(not r.scenario.shared and r.above_noise(LEAK_SDS) for r in results)


def add_audit_parser(commands: argparse._SubParsersAction) -> None:
    """The ``audit-timing`` subcommand and its options."""
    parser = commands.add_parser(
        "audit-timing", help="TTFT of cached vs fresh prefixes, within and across tenants"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument(
        "--key", action="append", default=[], help="a tenant's API key; give two for across"
    )
    parser.add_argument("--no-reuse-key", help="API key of a no_reuse tenant")
    parser.add_argument("--trials", type=int, default=20, help="trials per scenario")
    parser.add_argument("--prefix-words", type=int, default=400, help="~tokens per prefix")
    parser.add_argument("--seed", type=int, default=0)


def run_audit(args: argparse.Namespace) -> int:
    """0: no leak across isolating boundaries; 1: a leak; 2: the server could not be audited."""
    from prefixcache.tools.audit_client import ProbeClient

    if args.trials < 2 or args.prefix_words < 1:
        print("prefixcache audit-timing: --trials >= 2, --prefix-words >= 1", file=sys.stderr)
        return 2
    client = ProbeClient(args.url)
    try:
        found = scenarios(args.key, args.no_reuse_key)
        tokens, results = audit(client, found, args.trials, args.prefix_words, args.seed)
    except AuditError as error:
        print(f"prefixcache audit-timing: {error}", file=sys.stderr)
        return 2
    finally:
        client.close()
    print("\n".join(report(args.url, client.model, tokens, results)))
    return 1 if has_leak(results) else 0
