"""Rolling percentiles, the sliding window, attainment, burn and the Prometheus view."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.slo import RequestTiming, SloCollector, SloTracker, judge
from policies.surfaces import Budget
from routing.window import RollingCounts, RollingHistogram


class FakeClock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


def exact_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(q * len(ordered) + 0.999999) - 1)]


@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 0.99])
def test_histogram_quantiles_are_within_five_percent(q: float) -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(5.0, 1.0) for _ in range(20_000)]  # ~150 ms median, long tail
    hist = RollingHistogram(60.0)
    for v in values:
        hist.observe(v)
    got = hist.quantile(q)
    assert got is not None
    assert got == pytest.approx(exact_quantile(values, q), rel=0.05)


def test_histogram_window_slides() -> None:
    clock = FakeClock()
    hist = RollingHistogram(10.0, slots=5, clock=clock)
    for _ in range(100):
        hist.observe(1000.0)
    clock.now += 6.0
    for _ in range(100):
        hist.observe(10.0)
    assert hist.count() == 200
    p99 = hist.quantile(0.99)
    assert p99 is not None and p99 > 900
    clock.now += 5.0  # the slow slot is now older than the window
    assert hist.count() == 100
    p99 = hist.quantile(0.99)
    assert p99 is not None and p99 < 11
    clock.now += 20.0
    assert hist.quantile(0.5) is None


def test_rolling_counts_forget_old_slots() -> None:
    clock = FakeClock()
    counts = RollingCounts(2, 10.0, slots=10, clock=clock)
    counts.add(0, 3)
    clock.now += 5
    counts.add(1)
    assert counts.totals() == [3, 1]
    clock.now += 6
    assert counts.totals() == [0, 1]


def test_judge_checks_every_set_limit() -> None:
    budget = Budget(ttft_ms=500, itl_ms=50, total_ms=5000)
    assert judge(budget, RequestTiming(total_ms=4000, ttft_ms=400, itl_ms=40)).met
    v = judge(budget, RequestTiming(total_ms=6000, ttft_ms=600, itl_ms=40))
    assert (v.ttft, v.itl, v.total, v.met) == (True, False, True, False)
    assert not judge(budget, RequestTiming(total_ms=10, ok=False)).met
    assert judge(Budget(), RequestTiming(total_ms=99_999, ttft_ms=99_999)).met


def test_tracker_attainment_burn_and_percentiles() -> None:
    clock = FakeClock()
    tracker = SloTracker({"voice": Budget(ttft_ms=500, percentile=95)}, clock=clock)
    for i in range(100):
        ttft = 900.0 if i < 10 else 100.0  # 10% miss the TTFT budget
        tracker.observe("voice", RequestTiming(total_ms=ttft + 500, ttft_ms=ttft, itl_ms=20))
    tracker.observe("voice", RequestTiming(total_ms=5, ok=False))
    view = tracker.view()["voice"]
    assert view["requests"] == 101 and view["errors"] == 1
    assert view["attainment"] == pytest.approx(90 / 101)
    assert view["error_budget_burn"] == pytest.approx((11 / 101) / 0.05)
    assert view["met"]["ttft"] == pytest.approx(90 / 101)
    assert view["ttft_ms"]["p50"] == pytest.approx(100, rel=0.05)
    assert view["ttft_ms"]["p95"] == pytest.approx(900, rel=0.05)
    assert view["ttft_ms"]["at_budget_percentile"] == view["ttft_ms"]["p95"]
    assert view["budget"]["ttft_ms"] == 500


def test_unknown_surface_counts_as_default_and_reload_keeps_windows() -> None:
    tracker = SloTracker({"voice": Budget(ttft_ms=500)})
    tracker.observe("voice", RequestTiming(total_ms=100, ttft_ms=50))
    tracker.observe("nope", RequestTiming(total_ms=100))
    assert tracker.view()["default"]["requests"] == 1
    tracker.configure({"voice": Budget(ttft_ms=40), "batch": Budget(total_ms=60_000)})
    view = tracker.view()
    assert view["voice"]["requests"] == 1 and view["voice"]["budget"]["ttft_ms"] == 40
    assert set(view) == {"default", "voice", "batch"}


def test_prometheus_export() -> None:
    tracker = SloTracker({"voice": Budget(ttft_ms=500)})
    for _ in range(10):
        tracker.observe("voice", RequestTiming(total_ms=1000, ttft_ms=250))
    tracker.observe("voice", RequestTiming(total_ms=1000, ttft_ms=750))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SloCollector(lambda: tracker))
    text = generate_latest(registry).decode()
    assert 'llm_gateway_surface_budget_seconds{kind="ttft",surface="voice"} 0.5' in text
    assert 'llm_gateway_surface_requests_total{budget="met",surface="voice"} 10.0' in text
    assert 'llm_gateway_surface_requests_total{budget="missed",surface="voice"} 1.0' in text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("llm_gateway_surface_latency_seconds{")
        and 'kind="ttft"' in x
        and 'quantile="0.5"' in x
        and 'surface="voice"' in x
    )
    assert float(line.split()[-1]) == pytest.approx(0.25, rel=0.05)
    assert "llm_gateway_surface_budget_attainment" in text


def test_quantile_above_a_floor() -> None:
    hist = RollingHistogram(60.0)
    for v in range(1, 101):
        hist.observe(float(v))
    above = hist.quantile_above(0.5, 80.0)
    assert above is not None and above == pytest.approx(91, rel=0.06)
    assert hist.quantile_above(0.5, 500.0) is None
