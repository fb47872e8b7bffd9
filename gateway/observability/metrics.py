"""Prometheus metrics, one registry per app (no process globals).

Label children are cached per (model, backend, replica) so the hot path pays a dict lookup,
not ``labels()``. Replica state (health, outstanding requests, scraped vLLM load) is read at
scrape time by a collector instead of being updated on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.usage_metrics import UsageMetrics
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
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


class GatewayMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model", "backend", "replica"]
        self.requests = Counter(
            "llm_gateway_requests", "Requests answered", [*labels, "status"], registry=self.registry
        )
        self.duration = Histogram(
            "llm_gateway_request_duration_seconds",
            "End-to-end request latency as the gateway saw it",
            [*labels, "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llm_gateway_time_to_first_token_seconds",
            "Time from request arrival to the first streamed token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "llm_gateway_inter_token_latency_seconds",
            "Gap between consecutive streamed events",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.attempts = Counter(
            "llm_gateway_upstream_attempts",
            "Upstream attempts by outcome (ok, connect_error, http_5xx, http_4xx, timeout)",
            ["backend", "replica", "outcome"],
            registry=self.registry,
        )
        self.hedges = Counter(
            "llm_gateway_hedges",
            "Hedged requests by which attempt produced the first chunk (primary or hedge)",
            ["backend", "winner"],
            registry=self.registry,
        )
        self.deadlines = Counter(
            "llm_gateway_deadline_stops",
            "Responses ended by the gateway at the surface's total_ms",
            ["surface"],
            registry=self.registry,
        )
        self.tiers = Counter(
            "llm_gateway_tier_decisions",
            "Tiered models: route decisions (small, large) and cascade verdicts (kept, escalated)",
            ["model", "mode", "outcome"],
            registry=self.registry,
        )
        self.usage = UsageMetrics(self.registry)  # tenants' tokens, cost, limits
        self.registry.register(_ReplicaCollector(replicas))
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, key: tuple[str, ...]) -> Any:
        cache_key = (metric._name, *key)
        child = self._children.get(cache_key)
        if child is None:
            child = self._children[cache_key] = metric.labels(*key)
        return child

    def observe_request(
        self, model: str, backend: str, replica: str, status: int, seconds: float
    ) -> None:
        key = (model, backend, replica, str(status))
        self._child(self.requests, key).inc()
        self._child(self.duration, key).observe(seconds)

    def ttft_child(self, model: str, backend: str, replica: str) -> Any:
        return self._child(self.ttft, (model, backend, replica))

    def itl_child(self, model: str, backend: str, replica: str) -> Any:
        return self._child(self.itl, (model, backend, replica))

    def attempt(self, backend: str, replica: str, outcome: str) -> None:
        self._child(self.attempts, (backend, replica, outcome)).inc()

    def hedge(self, backend: str, winner: str) -> None:
        self._child(self.hedges, (backend, winner)).inc()

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
