"""Per-surface SLO tracking: rolling percentiles, budget attainment and error-budget burn.

Each surface keeps, over the last ``window_s`` (a ring of ``slots`` time slices, O(1) per
observation): TTFT, inter-token (the request's mean gap between tokens) and total latency
histograms, and counts of requests, requests that met every part of their budget, and errors.

A request *meets* its budget when each set limit holds (``ttft_ms``, ``itl_ms``, ``total_ms``)
and it did not fail; attainment is the share that met it. The budget's ``percentile`` (p95)
allows ``1 - 0.95`` = 5% of requests to miss: the *error-budget burn* is the observed miss
share divided by that allowance (1.0 spends the error budget exactly as fast as allowed; 14
would spend a 30-day budget in about two days). Lifetime met/missed counters are exported too,
so burn-rate alerts over other windows can be written in PromQL.

The orchestrator observes requests the surface is answerable for: gateway and upstream
failures count as misses, client errors (4xx) are not observed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from policies.surfaces import Budget
from routing.window import RollingCounts, RollingHistogram

QUANTILES = (0.5, 0.95, 0.99)
_REQUESTS, _MET, _ERRORS, _TTFT_MET, _ITL_MET, _TOTAL_MET = range(6)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    total_ms: float
    ttft_ms: float | None = None  # streams only
    itl_ms: float | None = None  # mean gap between tokens, streams with 2+ tokens
    ok: bool = True  # False: the gateway or the upstream failed the request


@dataclass(frozen=True, slots=True)
class Verdict:
    """Which parts of the budget one request broke (for span events and headroom)."""

    ttft: bool = False
    itl: bool = False
    total: bool = False
    failed: bool = False

    @property
    def met(self) -> bool:
        return not (self.ttft or self.itl or self.total or self.failed)


def judge(budget: Budget, timing: RequestTiming) -> Verdict:
    return Verdict(
        ttft=_over(timing.ttft_ms, budget.ttft_ms),
        itl=_over(timing.itl_ms, budget.itl_ms),
        total=_over(timing.total_ms, budget.total_ms),
        failed=not timing.ok,
    )


def _over(value: float | None, limit: float | None) -> bool:
    return value is not None and limit is not None and value > limit


class SurfaceSlo:
    def __init__(
        self, budget: Budget, window_s: float, slots: int, clock: Callable[[], float]
    ) -> None:
        self.budget = budget
        self.ttft = RollingHistogram(window_s, slots=slots, clock=clock)
        self.itl = RollingHistogram(window_s, slots=slots, clock=clock)
        self.total = RollingHistogram(window_s, slots=slots, clock=clock)
        self.counts = RollingCounts(6, window_s, slots=slots, clock=clock)
        self.lifetime_met = 0
        self.lifetime_missed = 0

    def observe(self, timing: RequestTiming) -> Verdict:
        verdict = judge(self.budget, timing)
        self.total.observe(timing.total_ms)
        if timing.ttft_ms is not None:
            self.ttft.observe(timing.ttft_ms)
        if timing.itl_ms is not None:
            self.itl.observe(timing.itl_ms)
        counts = self.counts
        counts.add(_REQUESTS)
        if verdict.met:
            counts.add(_MET)
            self.lifetime_met += 1
        else:
            self.lifetime_missed += 1
        if verdict.failed:
            counts.add(_ERRORS)
        else:
            counts.add(_TTFT_MET, 0 if verdict.ttft else 1)
            counts.add(_ITL_MET, 0 if verdict.itl else 1)
            counts.add(_TOTAL_MET, 0 if verdict.total else 1)
        return verdict

    def view(self) -> dict[str, Any]:
        requests, met, errors, ttft_met, itl_met, total_met = self.counts.totals()
        allowed = 1.0 - self.budget.percentile / 100.0
        attainment = met / requests if requests else None
        burn = (1.0 - attainment) / allowed if attainment is not None else None
        b = self.budget
        return {
            "budget": {
                "ttft_ms": b.ttft_ms,
                "itl_ms": b.itl_ms,
                "total_ms": b.total_ms,
                "percentile": b.percentile,
            },
            "window_s": self.counts.window_s,
            "requests": requests,
            "errors": errors,
            "attainment": attainment,
            "error_budget_burn": burn,
            "met": {
                "ttft": ttft_met / requests if requests else None,
                "itl": itl_met / requests if requests else None,
                "total": total_met / requests if requests else None,
            },
            "ttft_ms": _percentiles(self.ttft, b.percentile),
            "itl_ms": _percentiles(self.itl, b.percentile),
            "total_ms": _percentiles(self.total, b.percentile),
        }


def _percentiles(hist: RollingHistogram, budget_percentile: float) -> dict[str, float | None]:
    counts = hist.merged()
    out = {f"p{round(q * 100)}": _round(hist.quantile(q, counts)) for q in QUANTILES}
    out["at_budget_percentile"] = _round(hist.quantile(budget_percentile / 100.0, counts))
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class SloTracker:
    """Every surface's SLO window; the ``default`` surface (no budget) is tracked too."""

    def __init__(
        self,
        budgets: Mapping[str, Budget],
        *,
        window_s: float = 300.0,
        slots: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.slots = slots
        self._clock = clock
        self.surfaces: dict[str, SurfaceSlo] = {}
        self.configure(budgets)

    def configure(self, budgets: Mapping[str, Budget]) -> None:
        """Apply the surfaces of a (re)loaded policy; windows of kept surfaces survive."""
        wanted = {"default": Budget(), **budgets}
        fresh: dict[str, SurfaceSlo] = {}
        for name, budget in wanted.items():
            slo = self.surfaces.get(name)
            if slo is None:
                slo = SurfaceSlo(budget, self.window_s, self.slots, self._clock)
            slo.budget = budget
            fresh[name] = slo
        self.surfaces = fresh

    def observe(self, surface: str, timing: RequestTiming) -> Verdict:
        slo = self.surfaces.get(surface) or self.surfaces["default"]
        return slo.observe(timing)

    def view(self) -> dict[str, Any]:
        """The body of ``GET /admin/surfaces``."""
        return {name: slo.view() for name, slo in self.surfaces.items()}


class SloCollector(Collector):
    """Prometheus view of a tracker, read at scrape time (register it on the app's registry)."""

    def __init__(self, tracker: Callable[[], SloTracker]) -> None:
        self._tracker = tracker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        latency = GaugeMetricFamily(
            "llm_gateway_surface_latency_seconds",
            "Rolling latency percentiles per surface (kind: ttft, itl, total)",
            labels=["surface", "kind", "quantile"],
        )
        budget = GaugeMetricFamily(
            "llm_gateway_surface_budget_seconds",
            "The surface's latency budget (kind: ttft, itl, total)",
            labels=["surface", "kind"],
        )
        attainment = GaugeMetricFamily(
            "llm_gateway_surface_budget_attainment",
            "Share of the window's requests that met every part of their budget",
            labels=["surface"],
        )
        burn = GaugeMetricFamily(
            "llm_gateway_surface_error_budget_burn",
            "Miss share over the share the budget's percentile allows (1 = on budget)",
            labels=["surface"],
        )
        outcomes = CounterMetricFamily(
            "llm_gateway_surface_requests",
            "Requests per surface by budget outcome (met, missed)",
            labels=["surface", "budget"],
        )
        for name, slo in self._tracker().surfaces.items():
            b = slo.budget
            for kind, hist, limit in (
                ("ttft", slo.ttft, b.ttft_ms),
                ("itl", slo.itl, b.itl_ms),
                ("total", slo.total, b.total_ms),
            ):
                counts = hist.merged()
                for q in QUANTILES:
                    value = hist.quantile(q, counts)
                    if value is not None:
                        latency.add_metric([name, kind, str(q)], value / 1000.0)
                if limit is not None:
                    budget.add_metric([name, kind], limit / 1000.0)
            view = slo.view()
            if view["attainment"] is not None:
                attainment.add_metric([name], view["attainment"])
                burn.add_metric([name], view["error_budget_burn"])
            outcomes.add_metric([name, "met"], slo.lifetime_met)
            outcomes.add_metric([name, "missed"], slo.lifetime_missed)
        yield latency
        yield budget
        yield attainment
        yield burn
        yield outcomes
