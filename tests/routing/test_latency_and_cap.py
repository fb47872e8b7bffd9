"""TTFT prediction, budget-aware choice, and the max_tokens cap maths."""

from __future__ import annotations

import pytest

from routing.latency import ReplicaLatency, choose_for_budget
from routing.output_cap import cap_max_tokens, requested_max_tokens, with_max_tokens
from routing.replica import Replica


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replicas(n: int) -> list[Replica]:
    return [Replica("b", f"http://10.0.0.{i}:8000/v1") for i in range(n)]


def test_prediction_scales_with_the_queue_and_adds_uncached_prefill() -> None:
    lat = ReplicaLatency(alpha=1.0, prefill_ms_per_token=0.5)
    lat.observe_ttft("a", 300.0, queue=1.0, uncached_tokens=200)  # 100 ms of it is prefill
    assert lat.predict_ttft_ms("a", queue=1.0) == pytest.approx(200.0)
    assert lat.predict_ttft_ms("a", queue=3.0) == pytest.approx(400.0)
    assert lat.predict_ttft_ms("a", queue=1.0, uncached_tokens=1000) == pytest.approx(700.0)
    assert lat.predict_ttft_ms("unknown") is None


def test_prediction_expires_so_an_avoided_replica_is_probed_again() -> None:
    clock = FakeClock()
    lat = ReplicaLatency(stale_s=30.0, clock=clock)
    lat.observe_ttft("a", 100.0)
    clock.now += 31.0
    assert lat.predict_ttft_ms("a") is None


def test_ewma_follows_a_replica_that_turned_slow() -> None:
    lat = ReplicaLatency(alpha=0.2)
    for _ in range(20):
        lat.observe_ttft("a", 100.0)
    for _ in range(20):
        lat.observe_ttft("a", 500.0)
    predicted = lat.predict_ttft_ms("a")
    assert predicted is not None and predicted > 490


def test_budget_choice_keeps_a_replica_that_meets_the_budget() -> None:
    rs = replicas(3)
    lat = ReplicaLatency(alpha=1.0)
    for r, ttft in zip(rs, [150.0, 100.0, 50.0], strict=True):
        lat.observe_ttft(r.base_url, ttft)
    assert choose_for_budget(rs[0], rs, lat, 500.0) is rs[0]
    assert choose_for_budget(rs[0], rs, lat, 120.0) is rs[2]  # both others meet it: the
    # least loaded (a tie here), then the fastest predicted


def test_budget_choice_avoids_a_replica_far_slower_than_the_typical_one() -> None:
    rs = replicas(4)
    lat = ReplicaLatency(alpha=1.0)
    for r, ttft in zip(rs, [60.0, 55.0, 65.0, 300.0], strict=True):
        lat.observe_ttft(r.base_url, ttft)
    # 300 ms meets a 500 ms budget, but it is five times the typical 60 ms.
    assert choose_for_budget(rs[3], rs, lat, 500.0) is not rs[3]
    assert choose_for_budget(rs[2], rs, lat, 500.0) is rs[2]  # ordinary spread stays


def test_budget_choice_spreads_what_it_takes_from_a_slow_replica_by_load() -> None:
    rs = replicas(3)
    lat = ReplicaLatency(alpha=1.0)
    for r, ttft in zip(rs, [50.0, 60.0, 400.0], strict=True):
        lat.observe_ttft(r.base_url, ttft)
    for r in rs:
        r.waiting = 0.0  # scraped: an empty vLLM queue everywhere, so predictions stay put
    rs[0].outstanding = 3  # the fastest is busier: the other good one takes the request
    assert choose_for_budget(rs[2], rs, lat, 500.0) is rs[1]


def test_budget_choice_ignores_unknown_replicas_and_keeps_unknown_choice() -> None:
    rs = replicas(3)
    lat = ReplicaLatency(alpha=1.0)
    lat.observe_ttft(rs[0].base_url, 900.0)
    assert choose_for_budget(rs[0], rs, lat, 300.0) is rs[0]  # no better-known alternative
    assert choose_for_budget(rs[1], rs, lat, 300.0) is rs[1]  # unknown: trust the router


def test_budget_choice_sees_a_queue_building_up() -> None:
    rs = replicas(2)
    lat = ReplicaLatency(alpha=1.0)
    for r in rs:
        lat.observe_ttft(r.base_url, 100.0, queue=0.0)
    rs[0].outstanding = 9  # ten times the queue it had: predicted 1000 ms
    assert choose_for_budget(rs[0], rs, lat, 500.0) is rs[1]


@pytest.mark.parametrize(
    ("total", "elapsed", "ttft", "itl", "requested", "expected"),
    [
        (5000, 0, 500, 10, None, 451),  # 500 + 450 x 10 = 5000
        (5000, 0, 500, 10, 1000, 451),
        (5000, 0, 500, 10, 300, None),  # the client asked for less: untouched
        (5000, 1000, 500, 10, None, 351),  # time already spent in the gateway counts
        (5000, 0, 6000, 10, None, 1),  # nothing fits: the floor
        (5000, 0, 500, None, 1000, None),  # no observed ITL yet: no cap
        (5000, 0, 500, 0.0, 1000, None),
    ],
)
def test_cap_max_tokens(
    total: float,
    elapsed: float,
    ttft: float,
    itl: float | None,
    requested: int | None,
    expected: int | None,
) -> None:
    got = cap_max_tokens(
        total_ms=total, elapsed_ms=elapsed, ttft_ms=ttft, itl_ms=itl, requested=requested
    )
    assert got == expected
    if got is not None:
        assert ttft + elapsed + (got - 1) * (itl or 0) <= total or got == 1


def test_cap_is_written_where_the_client_asked() -> None:
    assert with_max_tokens({"max_completion_tokens": 900}, 50) == {"max_completion_tokens": 50}
    assert with_max_tokens({"max_tokens": 900}, 50) == {"max_tokens": 50}
    assert with_max_tokens({"model": "m"}, 50) == {"model": "m", "max_tokens": 50}
    assert requested_max_tokens({"max_tokens": 7}) == 7
    assert requested_max_tokens({"max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert requested_max_tokens({"max_tokens": True}) is None
