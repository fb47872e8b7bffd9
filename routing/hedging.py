"""When and where to hedge: the delay, the rate bound, and the hedge's replica.

The race itself (two attempts, the first chunk wins) is ``gateway.upstream.race``.

``HedgeBudget`` is a token bucket that starts empty: each request adds ``max_fraction`` of a
token (saved up to ``burst``), each hedge spends one, so hedges never exceed
``max_fraction x requests``; ``burst`` only lets unused allowance of quiet periods serve a
cluster of late requests.

``hedge_delay_s`` implements ``delay_ms: auto``, from what a fresh attempt elsewhere usually
takes (the median over the *other* replicas of their recent TTFT quantiles; the median ignores
one sick peer): the replica's recent TTFT p95, no longer than the typical peer's p90, and
never past the TTFT budget. A replica that turned slow would otherwise wait for its own slow
p95 before hedging, and a hedge costs the delay plus a fresh TTFT. A primary known to be slow
(its recent p50 over ``SLOW_RATIO`` times the typical peer's p50) waits only the typical p50:
its hedge will be needed anyway, and by then half of a healthy replica's answers have come,
so a replica that recovered still wins its races and shows it.

``worth_hedging`` spends a token only where a hedge can win: at the delay, the primary's
expected remaining wait (the median of its recent TTFTs that were longer than the time
already waited, minus that time) must exceed a fresh attempt's typical TTFT (the median of
the other replicas' p50s). A healthy replica's late first token is usually only a little
late, so its hedges would mostly lose; a slow replica's is not. A wait longer than anything
the replica recently did is always worth a hedge.

``HedgePolicy`` ties these together for one surface, and closes the loop on the latency
tracker: the hedge goes to the given replica (the router's ``peek`` among the others, which
moves no turn: a prefix router's replica holding the prompt's prefix; else the least loaded
other one) unless that replica is predicted slower than the typical candidate (then to the one
predicted fastest), and the attempt that lost a race
is recorded as censored (``ReplicaLatency.observe_lost``), so a replica whose attempts keep
being cancelled predicts slow instead of looking fast and idle.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from policies.surfaces import HedgeConfig
from routing.latency import SLOW_RATIO, ReplicaLatency, queue_of
from routing.replica import Replica


class HedgeBudget:
    """Token bucket that keeps hedges below ``max_fraction`` of requests (plus ``burst``)."""

    __slots__ = ("burst", "hedges", "max_fraction", "requests", "tokens")

    def __init__(self, max_fraction: float, burst: float = 10.0) -> None:
        if not 0 < max_fraction <= 1 or burst < 1:
            raise ValueError("max_fraction must be in (0, 1] and burst >= 1")
        self.max_fraction = max_fraction
        self.burst = burst
        self.tokens = 0.0
        self.requests = 0
        self.hedges = 0

    def on_request(self) -> None:
        self.requests += 1
        self.tokens = min(self.burst, self.tokens + self.max_fraction)

    def try_hedge(self) -> bool:
        if self.tokens < 1.0 - 1e-9:  # ten additions of 0.1 make 0.9999999999999999
            return False
        self.tokens = max(self.tokens - 1.0, 0.0)
        self.hedges += 1
        return True


def hedge_delay_s(
    config: HedgeConfig,
    latency: ReplicaLatency,
    replica_key: str,
    peers: Sequence[str],
    ttft_budget_ms: float | None,
) -> float | None:
    """Seconds to wait for the first chunk before hedging; None: do not hedge this request."""
    if not config.enabled:
        return None
    if config.delay_ms != "auto":
        return float(config.delay_ms) / 1000.0
    typical_p50 = typical_ttft_ms(latency, replica_key, peers, "p50")
    own_p50 = latency.ttft_p50_ms(replica_key)
    if own_p50 is not None and typical_p50 is not None and own_p50 > SLOW_RATIO * typical_p50:
        candidates = [typical_p50]
    else:
        own = latency.ttft_p95_ms(replica_key)
        typical = typical_ttft_ms(latency, replica_key, peers, "p90")
        candidates = [v for v in (own, typical) if v is not None]
    if ttft_budget_ms is not None:
        candidates.append(ttft_budget_ms)
    if not candidates:
        return None  # nothing observed yet and no budget: no basis for a delay
    return max(min(candidates), config.min_delay_ms) / 1000.0


def typical_ttft_ms(
    latency: ReplicaLatency, primary_key: str, peers: Sequence[str], q: Literal["p50", "p90"]
) -> float | None:
    """The median over the replicas other than ``primary_key`` of their recent TTFT quantile
    ``q``: what a fresh attempt elsewhere usually takes. The median ignores one sick peer."""
    read = latency.ttft_p50_ms if q == "p50" else latency.ttft_p90_ms
    values = [v for v in (read(k) for k in peers if k != primary_key) if v is not None]
    return statistics.median(values) if values else None


def worth_hedging(
    latency: ReplicaLatency, primary_key: str, peers: Sequence[str], elapsed_ms: float
) -> bool:
    remaining = latency.remaining_ttft_ms(primary_key, elapsed_ms)
    if remaining is None:
        return True
    fresh = typical_ttft_ms(latency, primary_key, peers, "p50")
    return fresh is None or remaining > fresh


class HedgePolicy:
    """One surface's hedging: the delay, the worth-it check, the rate bound, the hedge's
    replica, and what a lost race teaches the latency tracker."""

    def __init__(self, config: HedgeConfig, latency: ReplicaLatency, burst: float = 10.0) -> None:
        self.config = config
        self.latency = latency
        self.budget = HedgeBudget(config.max_fraction, burst)

    def delay_s(
        self, primary_key: str, peers: Sequence[str], ttft_budget_ms: float | None
    ) -> float | None:
        """Count the request and return its hedge delay (None: no hedge for this request)."""
        if not self.config.enabled:
            return None
        self.budget.on_request()
        return hedge_delay_s(self.config, self.latency, primary_key, peers, ttft_budget_ms)

    def allow(self, primary_key: str, peers: Sequence[str], elapsed_ms: float) -> bool:
        """At the delay: hedge only if it can help and the rate bound has a token."""
        if not worth_hedging(self.latency, primary_key, peers, elapsed_ms):
            return False
        return self.budget.try_hedge()

    def target(self, pick: Replica, rest: Sequence[Replica]) -> Replica:
        """Where the hedge goes: ``pick`` (the router's pick among the other replicas, or the
        least loaded of them) unless it is predicted slower than the typical candidate; then
        the one predicted fastest."""
        predicted = [(p, r) for r in rest if (p := self.latency.predict(r)) is not None]
        if len(predicted) < 2:
            return pick
        mine = self.latency.predict(pick)
        if mine is not None and mine <= statistics.median(p for p, _ in predicted):
            return pick
        return min(predicted, key=lambda pr: pr[0])[1]

    def lost(self, replica: Replica, elapsed_ms: float) -> None:
        """An attempt on ``replica`` was cancelled ``elapsed_ms`` in: the other one won."""
        self.latency.observe_lost(replica.base_url, elapsed_ms, queue=queue_of(replica))
