"""The budgets benchmark's own arithmetic and policy texts (the runs themselves are bench/)."""

from __future__ import annotations

import pytest

from bench._budget_load import Sample, percentile, surface_stats
from bench.budgets import SCENARIOS, _surface, policy_text, wired
from policies.loader import parse_policy


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.95) == 95.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) is None


def test_surface_stats_window_scale_and_failures() -> None:
    samples = [
        Sample("i", started=10.0, ttft_s=0.2, ended=11.0, ok=True, status=200),
        Sample("i", started=10.5, ttft_s=1.2, ended=12.0, ok=True, status=200),
        Sample("i", started=11.0, ttft_s=None, ended=11.1, ok=False, status=503),
        Sample("i", started=5.0, ttft_s=0.1, ended=10.5, ok=True, status=200),  # warm-up
        Sample("b", started=10.0, ttft_s=0.1, ended=11.0, ok=True, status=200),
    ]
    stats = surface_stats(samples, "i", (10.0, 20.0), time_scale=2.0, ttft_budget_ms=500.0)
    assert (stats.requests, stats.errors) == (3, 1)
    assert stats.ttft_p50_ms == 100.0  # 0.2 s of wall at time_scale 2
    assert stats.ttft_p99_ms == 600.0
    assert stats.attainment == pytest.approx(1 / 3, abs=1e-4)  # one met, one late, one failed
    assert stats.throughput_rps == pytest.approx(3 / 5)  # 3 ended in 10 wall s = 5 sim s


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_policy_texts_are_valid_policies(scenario: str) -> None:
    urls = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]
    surfaces = {
        "interactive": _surface(
            "interactive",
            {"ttft_ms": 500, "percentile": "p95"},
            {"priority": "interactive", "actions": {"admission": True}},
        )
    }
    admission = {"max_outstanding_per_replica": 8} if wired() else None
    policy = parse_policy(policy_text(urls, surfaces, admission), "bench.yaml")
    assert policy.surfaces["interactive"].budget.ttft_ms == 500
