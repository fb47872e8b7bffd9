"""Merging workers' /metrics text: what adds up, what does not."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.group_ledger import Answer, MetricsLedger
from gateway.observability.group_metrics import merge_exposition


def _worker_text(requests: int, outstanding: int, healthy: int, p99: float) -> str:
    r = CollectorRegistry()
    Counter("llm_gateway_requests", "", ["status"], registry=r).labels("200").inc(requests)
    h = Histogram("llm_gateway_request_duration_seconds", "", buckets=(0.1, 1.0), registry=r)
    for _ in range(requests):
        h.observe(0.05)
    Gauge("llm_gateway_replica_outstanding", "", ["replica"], registry=r).labels("a").set(
        outstanding
    )
    Gauge("llm_gateway_replica_healthy", "", ["replica"], registry=r).labels("a").set(healthy)
    Gauge("llm_gateway_surface_budget_seconds", "", ["surface"], registry=r).labels("s").set(0.5)
    Gauge("llm_gateway_surface_latency_seconds", "", ["surface"], registry=r).labels("s").set(p99)
    return generate_latest(r).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_counters_and_histograms_add_gauges_follow_their_rule() -> None:
    merged = _samples(
        merge_exposition(
            [(0, _worker_text(3, 2, 1, 0.2)), (1, _worker_text(5, 1, 0, 0.4))]
        ).decode()
    )
    assert merged[("llm_gateway_requests_total", (("status", "200"),))] == 8
    assert merged[("llm_gateway_request_duration_seconds_count", ())] == 8
    assert merged[("llm_gateway_request_duration_seconds_bucket", (("le", "0.1"),))] == 8
    assert merged[("llm_gateway_replica_outstanding", (("replica", "a"),))] == 3
    assert merged[("llm_gateway_replica_healthy", (("replica", "a"),))] == 0  # one worker says down
    assert merged[("llm_gateway_surface_budget_seconds", (("surface", "s"),))] == 0.5
    latency = "llm_gateway_surface_latency_seconds"
    assert merged[(latency, (("surface", "s"), ("worker", "0")))] == 0.2
    assert merged[(latency, (("surface", "s"), ("worker", "1")))] == 0.4
    assert (latency, (("surface", "s"),)) not in merged


def _requests(text: bytes) -> float:
    return _samples(text.decode())[("llm_gateway_requests_total", (("status", "200"),))]


async def test_the_ledger_keeps_counts_of_replaced_and_silent_workers(tmp_path: Path) -> None:
    ledger = MetricsLedger(tmp_path, 2)
    first = await ledger.group_text(
        {
            0: Answer(100, 1, _worker_text(3, 2, 1, 0.2)),
            1: Answer(101, 1, _worker_text(5, 1, 1, 0.4)),
        }
    )
    assert _requests(first) == 8
    # worker 1 is silent for a scrape: its last counts stay, its stale gauges do not
    silent = await ledger.group_text({0: Answer(100, 2, _worker_text(4, 0, 1, 0.2))})
    assert _requests(silent) == 9
    gauges = _samples(silent.decode())
    assert gauges[("llm_gateway_replica_outstanding", (("replica", "a"),))] == 0
    assert (
        "llm_gateway_surface_latency_seconds",
        (("surface", "s"), ("worker", "1")),
    ) not in gauges
    # worker 1 died; its replacement (a new pid) starts from zero: the sum still goes up
    replaced = await ledger.group_text(
        {
            0: Answer(100, 3, _worker_text(4, 0, 1, 0.2)),
            1: Answer(102, 1, _worker_text(1, 0, 1, 0.1)),
        }
    )
    assert _requests(replaced) == 4 + 5 + 1
    hist = _samples(replaced.decode())
    assert hist[("llm_gateway_request_duration_seconds_count", ())] == 10
    # the replacement dies too, before answering again, and worker 0 is replaced: both kept
    again = await ledger.group_text({0: Answer(103, 1, _worker_text(0, 0, 1, 0.1))})
    assert _requests(again) == 4 + 5 + 1
    # an older answer of the same process (a concurrent scrape finishing late) does not rewind
    await ledger.group_text({0: Answer(103, 3, _worker_text(6, 0, 1, 0.1))})
    await ledger.group_text({0: Answer(103, 2, _worker_text(2, 0, 1, 0.1))})
    assert _requests(await ledger.group_text({})) == 6 + 4 + 5 + 1
