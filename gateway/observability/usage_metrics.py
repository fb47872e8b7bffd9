"""Prometheus series of tenants' usage, cost and limits, and of upstream rate limits.

Labels come only from the policy: ``tenant`` (a policy tenant, or ``anonymous`` when none is
configured), ``surface`` (a policy surface, or ``default``), ``model`` (an alias the runtime
knows: a request naming anything else ended with a 404 before it was counted), ``backend``.
So the series stay bounded whatever clients send. Cost counters are USD as doubles: the one
place a cost is rounded (``gateway.limits.cost``).

| series | labels |
| --- | --- |
| ``llm_gateway_tenant_requests_total`` (answered: ``source`` upstream or cache) | tenant, surface, model, source |
| ``llm_gateway_tokens_total`` (``kind``: input, cached_input, output; upstream tokens) | tenant, surface, model, kind |
| ``llm_gateway_cost_usd_total`` | tenant, surface, model |
| ``llm_gateway_rate_limited_total`` (``reason``: requests, tokens, concurrency, budget, unavailable) | tenant, surface, reason |
| ``llm_gateway_budget_downgrades_total`` | tenant, surface |
| ``llm_gateway_budget_alerts_total`` | tenant, window, fraction |
| ``llm_gateway_limits_unavailable_total`` (decisions taken while the limit store was down) | direction |
| ``llm_gateway_limits_granted_total`` (limited requests admitted from a grant, no store call) | - |
| ``llm_gateway_limits_undos_dropped_total`` (lost checks' undos dropped past 10,000 waiting) | - |
| ``llm_gateway_limits_records_lost_total`` (usage records never written) | reason |
| ``llm_gateway_upstream_rate_limited_total`` (429s from a backend) | backend |
| ``llm_gateway_upstream_rate_limit_wait_seconds`` (waiting for a backend's limit to reset) | backend |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.limits.cost import Usage, usd_float
from gateway.limits.limiter import Limiter

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "llm_gateway_tenant_requests",
            "Answered requests per tenant, surface and model (source: upstream or cache)",
            ["tenant", "surface", "model", "source"],
            registry=registry,
        )
        self.tokens = Counter(
            "llm_gateway_tokens",
            "Upstream tokens per tenant, surface and model (kind: input, cached_input, output)",
            ["tenant", "surface", "model", "kind"],
            registry=registry,
        )
        self.cost = Counter(
            "llm_gateway_cost_usd",
            "Cost of answers in USD, from the models' prices",
            ["tenant", "surface", "model"],
            registry=registry,
        )
        self.refused = Counter(
            "llm_gateway_rate_limited",
            "Requests refused by a tenant's limits or budget",
            ["tenant", "surface", "reason"],
            registry=registry,
        )
        self.downgrades = Counter(
            "llm_gateway_budget_downgrades",
            "Requests served by a cheaper model because the tenant's budget was spent",
            ["tenant", "surface"],
            registry=registry,
        )
        self.upstream_limited = Counter(
            "llm_gateway_upstream_rate_limited",
            "429 answers from a backend (tried on the next target; not a health failure)",
            ["backend"],
            registry=registry,
        )
        self.upstream_wait = Histogram(
            "llm_gateway_upstream_rate_limit_wait_seconds",
            "Time requests waited for a backend's rate limit to reset (not model latency)",
            ["backend"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, key: tuple[str, ...]) -> Any:
        cache_key = (metric._name, *key)
        child = self._children.get(cache_key)
        if child is None:
            child = self._children[cache_key] = metric.labels(*key)
        return child

    def answered(
        self, tenant: str, surface: str, model: str, usage: Usage, cost: int | None, cached: bool
    ) -> None:
        base = (tenant, surface, model)
        self._child(self.requests, (*base, "cache" if cached else "upstream")).inc()
        for kind, count in (
            ("input", usage.input),
            ("cached_input", usage.cached_input),
            ("output", usage.output),
        ):
            if count:
                self._child(self.tokens, (*base, kind)).inc(count)
        if cost is not None:
            self._child(self.cost, base).inc(usd_float(cost))

    def refusal(self, tenant: str, surface: str, reason: str) -> None:
        self._child(self.refused, (tenant, surface, reason)).inc()


class LimiterCollector(Collector):
    """What the running limiter counted, read at scrape time."""

    def __init__(self, limiter: Callable[[], Limiter]) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[CounterMetricFamily]:
        limiter = self._limiter()
        alerts = CounterMetricFamily(
            "llm_gateway_budget_alerts",
            "Budget alerts fired (each alert_at fraction once per window, across instances)",
            labels=["tenant", "window", "fraction"],
        )
        counts = limiter.counts  # carried across limiters (a reload's new store): never back
        for (tenant, window, fraction), count in counts.alerts.items():
            alerts.add_metric([tenant, window, fraction], count)
        down = CounterMetricFamily(
            "llm_gateway_limits_unavailable",
            "Limit decisions taken while the limit store was unavailable",
            labels=["direction"],
        )
        for direction, count in limiter.counts.unavailable.items():
            down.add_metric([direction], count)
        granted = CounterMetricFamily(
            "llm_gateway_limits_granted",
            "Limited requests admitted from a grant, without a round trip to the limit store",
        )
        granted.add_metric([], counts.granted)
        dropped = CounterMetricFamily(
            "llm_gateway_limits_undos_dropped",
            "Undos of limit checks whose Redis answer was lost, dropped past the queue's bound "
            "(what they took expires after lease_ttl_s)",
        )
        dropped.add_metric([], counts.undos_dropped)
        lost = CounterMetricFamily(
            "llm_gateway_limits_records_lost",
            "Usage records (a tenant's day, week or month) never written to the limit store: "
            "script_error (its settlement failed in Redis's script: not sent again), "
            "pending_full (kept while Redis was away, past 10,000 records waiting)",
            labels=["reason"],
        )
        for reason, count in counts.records_lost.items():
            lost.add_metric([reason], count)
        yield alerts
        yield down
        yield granted
        yield dropped
        yield lost
