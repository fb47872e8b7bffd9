from __future__ import annotations

from routing.sglang_cache_aware import ApproxRadixTree, SGLangCacheAwareRouter, _common_prefix_len
from tests.routing.helpers import pool, req


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def recount(tree: ApproxRadixTree) -> dict[str, int]:
    sizes: dict[str, int] = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for t in node.tenants:
            sizes[t] = sizes.get(t, 0) + len(node.text)
        stack.extend(node.children.values())
    return sizes


def test_common_prefix_len() -> None:
    assert _common_prefix_len("abcdef", "xxabcxyz", 2) == 3
    assert _common_prefix_len("abc", "abc", 0) == 3
    assert _common_prefix_len("abc", "zbc", 0) == 0
    assert _common_prefix_len("abcd", "ab", 0) == 2


def test_tree_insert_split_match_and_counts() -> None:
    tree = ApproxRadixTree(Clock())
    for text, tenant in [
        ("apple", "w1"),
        ("apricot", "w1"),
        ("banana", "w1"),
        ("amplify", "w2"),
        ("application", "w2"),
        ("apartment", "w1"),
    ]:
        tree.insert(text, tenant)
    assert tree.char_count == recount(tree)
    assert tree.prefix_match("applesauce")[0] == 5
    assert tree.prefix_match("applesauce")[1] in ("w1", "w2")
    assert tree.prefix_match("bandana") == (3, "w1")
    assert tree.prefix_match("zebra") == (0, "w1")  # the root's first tenant, rate 0


def test_smallest_tenant_and_eviction_to_size() -> None:
    tree = ApproxRadixTree(Clock())
    tree.insert("ap", "w1")
    tree.insert("icot", "w1")
    tree.insert("cat", "w2")
    assert tree.smallest_tenant() == "w2"
    tree.insert("x" * 50, "w1")
    tree.insert("y" * 50, "w1")  # newer than the x run
    tree.evict_by_size(60)
    assert tree.tenant_chars("w1") <= 60
    assert tree.char_count == recount(tree)
    assert tree.prefix_match("y" * 50)[0] == 50  # the most recent survives
    assert tree.prefix_match("x" * 50)[0] == 0
    assert tree.tenant_chars("w2") == 3


def test_router_prefers_matching_worker_when_balanced() -> None:
    r = SGLangCacheAwareRouter(clock=Clock())
    replicas = pool(4)
    text = "You are a pirate. " * 40
    first = r.choose(replicas, req(text + "Q1"))
    assert first is not None
    for q in ("Q2", "Q3"):
        d = r.choose(replicas, req(text + q))
        assert d is not None and d.replica is first.replica and d.reason == "prefix"


def test_router_low_match_goes_to_smallest_tree() -> None:
    r = SGLangCacheAwareRouter(clock=Clock())
    replicas = pool(3)
    r.choose(replicas, req("a" * 500))
    d = r.choose(replicas, req("b" * 500))
    assert d is not None and d.reason == "cold"
    # Two workers have 500 chars; the third still has none and is the smallest.
    d3 = r.choose(replicas, req("c" * 500))
    assert d3 is not None
    assert len({r.trees["m"].tenant_chars(x.name) for x in replicas}) == 1


def test_router_balances_only_past_both_thresholds() -> None:
    r = SGLangCacheAwareRouter(balance_abs_threshold=4, balance_rel_threshold=1.5, clock=Clock())
    replicas = pool(2)
    text = "shared system prompt " * 30
    home = r.choose(replicas, req(text + "1"))
    assert home is not None
    other = replicas[1] if home.replica is replicas[0] else replicas[0]
    home.replica.outstanding = 4  # diff 4, not > 4: still cache-aware
    d = r.choose(replicas, req(text + "2"))
    assert d is not None and d.replica is home.replica
    home.replica.outstanding = 6  # diff 6 > 4 and 6 > 0 * 1.5
    d = r.choose(replicas, req(text + "3"))
    assert d is not None and d.replica is other and d.reason == "load"


def test_periodic_eviction_runs_in_choose() -> None:
    clock = Clock()
    r = SGLangCacheAwareRouter(eviction_interval_secs=5, max_tree_size=100, clock=clock)
    replicas = pool(1)
    for i in range(10):
        r.choose(replicas, req(f"{i}" * 200))
    assert r.trees["m"].tenant_chars(replicas[0].name) <= 100 + 200
