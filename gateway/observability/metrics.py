"""Prometheus metrics, one registry per app (no process globals).

The request path's counters and histograms are ``gateway.observability.loop_metrics``
families: unlocked numbers updated on the event loop, exposed at scrape time, with the series
prometheus_client's own classes would give. Replica state (health, outstanding requests,
scraped vLLM load) is read at scrape time by a collector instead of being updated on every
request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.loop_metrics import (
    HistogramChild,
    LoopCounter,
    LoopHistogram,
)
from gateway.observability.usage_metrics import UsageMetrics
from routing.kv_events import SubscriberStats
from routing.pool import BackendPool
from routing.prefix import PrecisePrefixRouter
from routing.replica import Replica

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_STATUS = {code: str(code) for code in range(100, 600)}  # no str() per request
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ReloadCollector(Collector):
    """``llm_gateway_policy_reloads_total{result}`` and ``llm_gateway_policy_reload_failing``,
    read at scrape time from ``counts``: (accepted, rejected, whether the last was rejected)."""

    def __init__(self, counts: Callable[[], tuple[int, int, bool]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        accepted, rejected, failing = self._counts()
        reloads = CounterMetricFamily(
            "llm_gateway_policy_reloads",
            "Policy reloads finished, by result (a rejected file leaves the running policy)",
            labels=["result"],
        )
        reloads.add_metric(["accepted"], accepted)
        reloads.add_metric(["rejected"], rejected)
        yield reloads
        yield GaugeMetricFamily(
            "llm_gateway_policy_reload_failing",
            "1 while the last reload was rejected: the file differs from the running policy",
            value=1 if failing else 0,
        )


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "llm_gateway_replica_healthy",
            "1 if the replica takes traffic",
            labels=["backend", "replica"],
        )
        outstanding = GaugeMetricFamily(
            "llm_gateway_replica_outstanding",
            "Requests the gateway has in flight on the replica",
            labels=["backend", "replica"],
        )
        for r in self._replicas():
            healthy.add_metric([r.backend, r.name], 1.0 if r.healthy else 0.0)
            outstanding.add_metric([r.backend, r.name], float(r.outstanding))
        yield healthy
        yield outstanding


class KVEventCollector(Collector):
    """``llm_gateway_kv_events_total{backend,replica,event}``: what each replica's KV-event
    subscriber saw (strategy prefix_precise), read at scrape time from its stats.

    A reload that changes a backend (any of its settings) builds a new router, whose
    subscribers count from zero. So that the series never goes back, what a stopped subscriber
    counted is kept (``_retired``) and added to its successor's counts, for as long as the
    replica stays in the backend (a strategy changed away from prefix_precise and back
    included; a removed replica's series ends). A subscriber is known stopped when a scrape no
    longer finds it; its stats object, held since the last scrape, has its final counts. (A
    router built and replaced between two scrapes is never seen: its counts are missed, and
    the series still does not go back.)"""

    EVENTS = tuple(f for f in SubscriberStats.__slots__ if f != "last_seq")

    def __init__(self, pools: Callable[[], Iterable[BackendPool]]) -> None:
        self._pools = pools
        self._seen: dict[tuple[str, str], SubscriberStats] = {}  # at the last scrape
        self._retired: dict[tuple[str, str], Counter[str]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "llm_gateway_kv_events",
            "KV-event subscribers: batches and events published while followed, gaps, "
            "batches replayed and lost, synced (re-learned from the replay buffer), engine "
            "restarts, unreadable messages, bad_batches (skipped), index resets",
            labels=["backend", "replica", "event"],
        )
        pools = list(self._pools())
        live = {
            (pool.name, replica): sub.stats
            for pool in pools
            if isinstance(pool.router, PrecisePrefixRouter)
            for replica, sub in pool.router.events.subscribers.items()
        }
        for key, stats in self._seen.items():
            if live.get(key) is not stats:
                retired = self._retired.setdefault(key, Counter())
                retired.update({event: getattr(stats, event) for event in self.EVENTS})
        self._seen = live
        in_policy = {(pool.name, r.name) for pool in pools for r in pool.replicas}
        self._retired = {k: v for k, v in self._retired.items() if k in in_policy}
        for key, stats in live.items():
            before = self._retired.get(key, Counter())
            for event in self.EVENTS:
                family.add_metric([*key, event], float(getattr(stats, event) + before[event]))
        yield family


class GatewayMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model", "backend", "replica"]
        self.requests = LoopCounter(
            "llm_gateway_requests", "Requests answered", [*labels, "status"], registry=self.registry
        )
        self.duration = LoopHistogram(
            "llm_gateway_request_duration_seconds",
            "End-to-end request latency as the gateway saw it",
            [*labels, "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = LoopHistogram(
            "llm_gateway_time_to_first_token_seconds",
            "Time from request arrival to the first streamed token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = LoopHistogram(
            "llm_gateway_inter_token_latency_seconds",
            "Gap between consecutive streamed events",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.attempts = LoopCounter(
            "llm_gateway_upstream_attempts",
            "Upstream attempts by outcome, counted when each ends (ok, lost, cancelled, "
            "incomplete, http_4xx, http_429, http_5xx, connect_error, timeout, bad_status, "
            "rejected_key, bad_answer, no_connection, idle_timeout, answer_broken, stream_error, "
            "abandoned)",
            ["backend", "replica", "outcome"],
            registry=self.registry,
        )
        self.hedges = LoopCounter(
            "llm_gateway_hedges",
            "Hedged requests by which attempt produced the first chunk (primary or hedge)",
            ["backend", "winner"],
            registry=self.registry,
        )
        self.deadlines = LoopCounter(
            "llm_gateway_deadline_stops",
            "Responses ended by the gateway at the surface's total_ms",
            ["surface"],
            registry=self.registry,
        )
        self.tiers = LoopCounter(
            "llm_gateway_tier_decisions",
            "Tiered models: route decisions (small, large) and cascade verdicts (kept, escalated)",
            ["model", "mode", "outcome"],
            registry=self.registry,
        )
        self.usage = UsageMetrics(self.registry)  # tenants' tokens, cost, limits
        self.registry.register(_ReplicaCollector(replicas))

    def observe_request(
        self, model: str, backend: str, replica: str, status: int, seconds: float
    ) -> None:
        self.requests.labels(model, backend, replica, _STATUS.get(status) or str(status)).inc()
        self.duration.labels(model, backend, replica, _STATUS.get(status) or str(status)).observe(
            seconds
        )

    def ttft_child(self, model: str, backend: str, replica: str) -> HistogramChild:
        return self.ttft.labels(model, backend, replica)

    def itl_child(self, model: str, backend: str, replica: str) -> HistogramChild:
        return self.itl.labels(model, backend, replica)

    def attempt(self, backend: str, replica: str, outcome: str) -> None:
        self.attempts.labels(backend, replica, outcome).inc()

    def hedge(self, backend: str, winner: str) -> None:
        self.hedges.labels(backend, winner).inc()

    def requests_answered(self) -> int:
        """Requests this process answered (every label set of ``llm_gateway_requests``)."""
        return int(sum(child.value for child in self.requests.children.values()))

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
