from __future__ import annotations

from collections import Counter

from routing.session import HashRing, SessionRouter
from tests.routing.helpers import pool, req


def test_same_session_sticks() -> None:
    r = SessionRouter()
    replicas = pool(4)
    first = r.choose(replicas, req("hello", session="conv-1"))
    assert first is not None and first.reason == "session"
    for turn in range(5):
        d = r.choose(replicas, req(f"hello {turn} more text", session="conv-1"))
        assert d is not None and d.replica is first.replica


def test_without_session_key_tenant_and_prefix_decide() -> None:
    r = SessionRouter(prefix_chars=32)
    replicas = pool(4)
    base = "You are the support bot of ACME. " * 3
    a = r.choose(replicas, req(base + "Where is my order?", tenant="acme"))
    b = r.choose(replicas, req(base + "Cancel it, please.", tenant="acme"))
    assert a is not None and b is not None and a.replica is b.replica


def test_keys_spread_over_replicas() -> None:
    r = SessionRouter()
    replicas = pool(4)
    counts: Counter[str] = Counter()
    for i in range(2000):
        d = r.choose(replicas, req("x", session=f"s{i}"))
        assert d is not None
        counts[d.replica.name] += 1
    assert len(counts) == 4
    assert max(counts.values()) < 1.3 * 500


def test_removing_a_replica_moves_only_its_keys() -> None:
    replicas = pool(4)
    ring4 = HashRing([r.name for r in replicas], 160)
    ring3 = HashRing([r.name for r in replicas[:3]], 160)
    gone = replicas[3].name
    moved = 0
    for i in range(1000):
        before, after = ring4.walk(f"k{i}")[0], ring3.walk(f"k{i}")[0]
        if before != gone:
            assert before == after
        else:
            moved += 1
    assert 150 < moved < 350


def test_bounded_variant_walks_past_an_overloaded_replica() -> None:
    r = SessionRouter(bounded_load_epsilon=0.25)
    replicas = pool(4)
    home = r.choose(replicas, req("x", session="busy"))
    assert home is not None
    home.replica.outstanding = 10
    d = r.choose(replicas, req("x", session="busy"))
    assert d is not None and d.replica is not home.replica and d.reason == "load"
    plain = SessionRouter()
    d = plain.choose(replicas, req("x", session="busy"))
    assert d is not None and d.replica is home.replica
