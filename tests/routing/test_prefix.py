from __future__ import annotations

from routing.load import BalanceSettings
from routing.prefix import ApproximatePrefixRouter, ChunkIndex, text_chain
from tests.routing.helpers import pool, req, system_prompt

LOOSE = BalanceSettings(epsilon=10.0, slack=100.0, max_waiting=None, max_kv_usage=None)


def router(**kw: object) -> ApproximatePrefixRouter:
    kw.setdefault("chunk_chars", 64)
    kw.setdefault("load_smoothing_s", 0.0)  # instantaneous loads unless a test says otherwise
    return ApproximatePrefixRouter(**kw)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_chain_counts_only_full_chunks_and_is_prefix_stable() -> None:
    a = text_chain("x" * 130, 64)
    b = text_chain("x" * 128 + "yyyyyyyy" * 20, 64)
    assert len(a) == 2
    assert b[:2] == a
    assert text_chain("short", 64) == []
    # The same chunk text at another position hashes differently (it is a chain).
    assert len(set(text_chain("x" * 256, 64))) == 4


def test_requests_sharing_a_prefix_follow_the_first() -> None:
    r = router(balance=LOOSE)
    replicas = pool(4)
    sp = system_prompt("acme")
    first = r.choose(replicas, req(sp + " question one?"))
    assert first is not None and first.reason == "cold"
    for q in ("two", "three", "four", "five"):
        d = r.choose(replicas, req(sp + f" question {q}?"))
        assert d is not None
        assert d.replica is first.replica
        assert d.reason == "prefix"
        assert d.matched_prefix >= len(sp) - 64


def test_cold_prefixes_spread_over_idle_replicas() -> None:
    r = router()
    replicas = pool(4)
    chosen = []
    for tag in ("a", "b", "c", "d"):
        d = r.choose(replicas, req(system_prompt(tag)))
        assert d is not None and d.reason == "cold"
        d.replica.outstanding += 1  # in flight
        chosen.append(d.replica.name)
    assert len(set(chosen)) == 4


def test_cold_goes_to_least_loaded() -> None:
    r = router()
    replicas = pool(3)
    replicas[0].outstanding = 5
    replicas[1].outstanding = 1
    replicas[2].outstanding = 3
    d = r.choose(replicas, req(system_prompt("new")))
    assert d is not None and d.replica is replicas[1] and d.reason == "cold"


def test_affinity_yields_to_bounded_load_then_prefix_spreads() -> None:
    r = router(balance=BalanceSettings(epsilon=0.25, slack=1.0, max_waiting=None))
    replicas = pool(4)
    sp = system_prompt("hot")
    home = r.choose(replicas, req(sp + " q0"))
    assert home is not None
    home.replica.outstanding = 6  # others idle: mean with this request 7/4, bound 1.25*7/4+1
    d = r.choose(replicas, req(sp + " q1"))
    assert d is not None
    assert d.replica is not home.replica
    assert d.reason == "load"
    second = d.replica
    # The prefix now lives on two replicas; the less loaded of the two wins, as a prefix hit.
    second.outstanding = 1
    d2 = r.choose(replicas, req(sp + " q2"))
    assert d2 is not None and d2.replica is second and d2.reason == "prefix"


def test_affinity_holds_within_the_bound() -> None:
    r = router(balance=BalanceSettings(epsilon=0.25, slack=1.0, max_waiting=None))
    replicas = pool(4)
    sp = system_prompt("warm")
    home = r.choose(replicas, req(sp + " q0"))
    assert home is not None
    for other in replicas:
        other.outstanding = 2
    home.replica.outstanding = 3  # 3 + 1 <= 1.25 * 10/4 + 1
    d = r.choose(replicas, req(sp + " q1"))
    assert d is not None and d.replica is home.replica and d.reason == "prefix"


def test_queueing_or_full_kv_replica_yields() -> None:
    r = router(balance=BalanceSettings(epsilon=10, slack=100, max_waiting=0, max_kv_usage=0.9))
    replicas = pool(2)
    sp = system_prompt("q")
    home = r.choose(replicas, req(sp + " a"))
    assert home is not None
    home.replica.waiting = 3
    d = r.choose(replicas, req(sp + " b"))
    assert d is not None and d.replica is not home.replica and d.reason == "load"
    home.replica.waiting = 0
    home.replica.kv_usage = 0.95
    d = r.choose(replicas, req(sp + " c"))
    assert d is not None and d.replica is not home.replica


def test_scraped_queue_counts_as_load() -> None:
    r = router()
    replicas = pool(2)
    replicas[0].running, replicas[0].waiting = 7.0, 0.0  # busy with another gateway's work
    d = r.choose(replicas, req(system_prompt("x")))
    assert d is not None and d.replica is replicas[1]


def test_lru_capacity_evicts_old_prefixes_tail_first() -> None:
    index = ChunkIndex(chunk_chars=10, capacity_chunks=5)
    a = text_chain("a" * 30, 10)  # 3 chunks
    b = text_chain("b" * 30, 10)
    index.record("r", a)
    index.record("r", b)  # 6 > 5: the oldest entry goes, and that is a's tail
    assert index.size("r") == 5
    assert index.match("r", a) == 2
    assert index.match("r", b) == 3
    index.record("r", text_chain("c" * 50, 10))
    assert index.match("r", a) == 0


def test_evicted_prefix_is_routed_as_cold_again() -> None:
    r = router(kv_capacity_tokens=64, chars_per_token=4.0, balance=LOOSE)  # 4 chunks of 64
    replicas = pool(1)
    sp = system_prompt("old", 256)
    r.choose(replicas, req(sp))
    d = r.choose(replicas, req(sp))
    assert d is not None and d.reason == "prefix"
    r.choose(replicas, req(system_prompt("new", 256)))
    d = r.choose(replicas, req(sp))
    assert d is not None and d.reason == "cold"


def test_capacity_learned_from_metrics() -> None:
    from routing.metrics_scrape import VllmMetrics

    r = router(kv_capacity_tokens=10_000)
    replicas = pool(1)
    r.observe_metrics(replicas[0], VllmMetrics(num_gpu_blocks=4, block_size=16))
    assert r.chunks.capacity(replicas[0].name) == 4  # 64 tokens x 4 chars / 64


def test_empty_pool_gives_none() -> None:
    assert router().choose([], req("x")) is None


def test_a_burst_does_not_move_a_prefix_but_sustained_load_does() -> None:
    clock = Clock()
    bal = BalanceSettings(epsilon=0.25, slack=2.0, max_waiting=None)
    r = router(balance=bal, load_smoothing_s=10.0, clock=clock)
    replicas = pool(4)
    sp = system_prompt("burst")
    home = r.choose(replicas, req(sp + " q0"))
    assert home is not None
    clock.t = 1.0
    home.replica.outstanding = 8  # a one-second burst: the smoothed load is still low
    d = r.choose(replicas, req(sp + " q1"))
    assert d is not None and d.replica is home.replica and d.reason == "prefix"
    clock.t = 60.0  # the load stayed: now the smoothed load exceeds the bound too
    d = r.choose(replicas, req(sp + " q2"))
    assert d is not None and d.replica is not home.replica and d.reason == "load"


def test_new_prefixes_avoid_the_replica_with_the_most_recent_prefill_work() -> None:
    clock = Clock()
    r = router(clock=clock)
    replicas = pool(2)
    r.choose(replicas, req(system_prompt("big", 8000)))  # cold, lots of prefill on one replica
    loaded = [x for x in replicas if r.work.value(x.name) > 0]
    assert len(loaded) == 1
    for tag in ("n1", "n2", "n3"):
        d = r.choose(replicas, req(system_prompt(tag, 1000)))
        assert d is not None and d.reason == "cold" and d.replica is not loaded[0]


def test_peek_tells_the_choice_and_records_nothing() -> None:
    """What a hedge asks: the same answer as ``choose``, with no prefix indexed, no prefill
    work counted, no turn moved and no smoothed load taken in."""
    clock = Clock()
    r = router(balance=LOOSE, load_smoothing_s=10.0, clock=clock)
    replicas = pool(3)
    sp = system_prompt("peek")
    home = r.choose(replicas, req(sp + " q0"))
    assert home is not None
    others = [x for x in replicas if x is not home.replica]
    before = (r._turn, r.chunks.size(others[0].name), r.chunks.size(others[1].name))
    smoothed = dict(r.smoothed._value)
    clock.t = 5.0
    work = {x.name: r.work.value(x.name) for x in replicas}
    others[1].outstanding = 3
    for _ in range(3):
        peeked = r.peek(replicas, req(sp + " q1"))
        assert peeked is not None and peeked.replica is home.replica and peeked.reason == "prefix"
        cold = r.peek(others, req(sp + " q1"))  # the prefix is nowhere else: the least loaded
        assert cold is not None and cold.replica is others[0] and cold.reason == "cold"
    assert (r._turn, r.chunks.size(others[0].name), r.chunks.size(others[1].name)) == before
    assert r.smoothed._value == smoothed
    assert {x.name: r.work.value(x.name) for x in replicas} == work
    assert r.peek([], req(sp)) is None
