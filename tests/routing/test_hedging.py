"""Hedged races (deterministic fakes), the hedge rate bound, delay and target, lost races."""

from __future__ import annotations

import pytest

from policies.surfaces import HedgeConfig
from routing.hedging import HedgeBudget, HedgePolicy, hedge_delay_s, worth_hedging
from routing.latency import ReplicaLatency
from routing.replica import Replica


@pytest.mark.parametrize("burst", [1.0, 2.0, 10.0])
def test_hedge_budget_keeps_hedges_under_the_fraction(burst: float) -> None:
    budget = HedgeBudget(0.1, burst=burst)
    for i in range(1000):
        budget.on_request()
        budget.try_hedge()  # every request would like a hedge
        assert budget.hedges <= 0.1 * (i + 1) + 1e-9  # at every moment, not just on average
    assert budget.hedges >= 0.1 * 1000 - 1  # and the bound is reachable


def test_hedge_budget_saves_up_to_burst_only() -> None:
    budget = HedgeBudget(0.5, burst=2.0)
    for _ in range(100):
        budget.on_request()
    assert [budget.try_hedge() for _ in range(3)] == [True, True, False]


def latency_with(p95s: dict[str, float]) -> ReplicaLatency:
    lat = ReplicaLatency()
    for key, value in p95s.items():
        for _ in range(100):
            lat.observe_ttft(key, value)
    return lat


def test_fixed_delay_is_used_as_is() -> None:
    cfg = HedgeConfig(enabled=True, delay_ms=120)
    assert hedge_delay_s(cfg, ReplicaLatency(), "a", [], 500) == pytest.approx(0.12)


def test_disabled_hedge_has_no_delay() -> None:
    assert hedge_delay_s(HedgeConfig(), latency_with({"a": 50}), "a", ["a"], 500) is None


def test_auto_delay_is_the_replica_p95_capped_by_the_budget() -> None:
    cfg = HedgeConfig(enabled=True)
    lat = latency_with({"a": 100.0, "b": 110.0, "c": 120.0})
    delay = hedge_delay_s(cfg, lat, "a", ["a", "b", "c"], 500)
    assert delay is not None and 0.095 <= delay <= 0.105
    lat2 = latency_with({"a": 900.0})
    assert hedge_delay_s(cfg, lat2, "a", ["a"], 500) == pytest.approx(0.5)


def test_auto_delay_of_a_slow_replica_is_the_typical_replicas_p95() -> None:
    cfg = HedgeConfig(enabled=True)
    lat = latency_with({"slow": 1000.0, "b": 100.0, "c": 100.0, "d": 100.0})
    delay = hedge_delay_s(cfg, lat, "slow", ["slow", "b", "c", "d"], None)
    assert delay is not None and delay < 0.11


def test_auto_delay_is_what_a_fresh_attempt_elsewhere_usually_takes() -> None:
    cfg = HedgeConfig(enabled=True)
    lat = ReplicaLatency()
    for key in ("b", "c", "d"):
        for v in range(40, 140):  # p50 ~ 90 ms, p90 ~ 130 ms
            lat.observe_ttft(key, float(v))
    for v in range(100, 200):
        lat.observe_ttft("e", float(v))  # a little slower than typical: p50 ~ 150, p95 ~ 195
    for _ in range(100):
        lat.observe_ttft("slow", 600.0)
    peers = ["b", "c", "d", "e", "slow"]
    delay = hedge_delay_s(cfg, lat, "e", peers, 500)
    assert delay is not None and 0.12 <= delay <= 0.14  # the peers' p90, not its own p95
    # Known slow (p50 over twice the typical): hedge once half the typical answers are in.
    delay = hedge_delay_s(cfg, lat, "slow", peers, 500)
    assert delay is not None and 0.085 <= delay <= 0.095
    # A healthy primary's own figures do not count as "typical": with only a slow peer left,
    # it hedges at its own p95.
    own = hedge_delay_s(cfg, lat, "b", ["b", "slow"], 500)
    assert own is not None and own < 0.15


def test_auto_delay_has_a_floor_and_needs_some_basis() -> None:
    cfg = HedgeConfig(enabled=True, min_delay_ms=20)
    assert hedge_delay_s(cfg, latency_with({"a": 2.0}), "a", ["a"], 500) == pytest.approx(0.02)
    assert hedge_delay_s(cfg, ReplicaLatency(), "a", ["a"], None) is None


def test_worth_hedging_only_where_a_fresh_attempt_is_faster() -> None:
    lat = ReplicaLatency()
    for key in ("b", "c"):
        for v in range(50, 101):  # 50..100 ms, p50 ~ 75
            lat.observe_ttft(key, float(v))
    for _ in range(50):
        lat.observe_ttft("slow", 400.0)
    # A healthy replica 95 ms late: the few slower first tokens came a few ms later.
    assert not worth_hedging(lat, "b", ["b", "c", "slow"], 95.0)
    # The slow replica 95 ms in: about 300 ms still to wait, a fresh attempt takes ~75.
    assert worth_hedging(lat, "slow", ["b", "c", "slow"], 95.0)
    # Later than anything the replica did recently: always worth it.
    assert worth_hedging(lat, "b", ["b", "c", "slow"], 5000.0)


def test_hedge_policy_counts_requests_and_spends_tokens_only_when_worth_it() -> None:
    lat = ReplicaLatency()
    for key in ("b", "c"):
        for v in range(50, 101):
            lat.observe_ttft(key, float(v))
    for _ in range(50):
        lat.observe_ttft("slow", 400.0)
    policy = HedgePolicy(HedgeConfig(enabled=True, max_fraction=0.5), lat)
    peers = ["b", "c", "slow"]
    for _ in range(4):
        assert policy.delay_s("b", peers, 500.0) is not None
    assert not policy.allow("b", peers, 95.0)
    assert policy.allow("slow", peers, 95.0)
    assert policy.allow("slow", peers, 95.0)
    assert not policy.allow("slow", peers, 95.0)  # 4 requests x 0.5 = 2 hedges at most
    assert HedgePolicy(HedgeConfig(), lat).delay_s("b", peers, 500.0) is None


def test_a_lost_attempt_counts_as_the_ttft_its_replica_would_probably_have_had() -> None:
    lat = ReplicaLatency(alpha=1.0)
    for v in (100.0, 300.0, 400.0, 500.0):
        lat.observe_ttft("a", v)
    lat.observe_lost("a", 250.0)  # it was at least 250: like its recent ones above 250
    assert lat.predict_ttft_ms("a") == pytest.approx(400.0, rel=0.06)
    lat.observe_lost("new", 150.0)  # nothing known above: the elapsed time, a lower bound
    assert lat.predict_ttft_ms("new") == pytest.approx(150.0)


def test_a_replica_that_keeps_losing_races_predicts_slow() -> None:
    lat = ReplicaLatency()
    for _ in range(5):
        lat.observe_ttft("slow", 80.0)  # the few races it won, when it happened to be quick
    for _ in range(20):
        lat.observe_lost("slow", 140.0)  # cancelled 140 ms in, each time
    predicted = lat.predict_ttft_ms("slow")
    p50 = lat.ttft_p50_ms("slow")
    assert predicted is not None and predicted > 135
    assert p50 is not None and p50 > 130


def replicas_with(lat: ReplicaLatency, ttfts: list[float]) -> list[Replica]:
    rs = [Replica("b", f"http://10.0.0.{i}:8000/v1") for i in range(len(ttfts))]
    for r, v in zip(rs, ttfts, strict=True):
        r.waiting = 0.0
        lat.observe_ttft(r.base_url, v)
    return rs


def test_the_hedge_goes_to_its_pick_unless_it_is_predicted_slow() -> None:
    lat = ReplicaLatency(alpha=1.0)
    rs = replicas_with(lat, [60.0, 50.0, 70.0, 400.0])
    policy = HedgePolicy(HedgeConfig(enabled=True), lat)
    assert policy.target(rs[2], rs[1:]) is rs[2]  # typical: keep (it may hold the prefix)
    assert policy.target(rs[3], rs[1:]) is rs[1]  # predicted slow: the fastest instead
    unknown = Replica("b", "http://10.0.0.9:8000/v1")
    assert policy.target(unknown, [unknown, rs[0]]) is unknown  # too little known to judge


def test_a_lost_race_is_recorded_against_the_loser() -> None:
    lat = ReplicaLatency(alpha=1.0)
    (r,) = replicas_with(lat, [50.0])
    HedgePolicy(HedgeConfig(enabled=True), lat).lost(r, 300.0)
    assert lat.predict_ttft_ms(r.base_url) == pytest.approx(300.0)


def test_lost_races_never_make_their_replica_look_about_to_answer() -> None:
    """A replica cancelled 60 ms in, race after race, has only lower bounds of 60 ms: at 55 ms
    its first token is not "5 ms away", so a hedge is still worth it (it was not, when those
    bounds counted as first tokens that came)."""
    lat = ReplicaLatency()
    for _ in range(10):
        lat.observe_ttft("fast", 10.0)
        lat.observe_lost("slow", 60.0)
    assert lat.remaining_ttft_ms("slow", 55.0) is None  # slower than any first token seen
    assert worth_hedging(lat, "slow", ["slow", "fast"], 55.0)
    for _ in range(3):
        lat.observe_ttft("slow", 400.0)  # the few that came: what a late one is like
    remaining = lat.remaining_ttft_ms("slow", 55.0)
    assert remaining is not None and remaining > 300
