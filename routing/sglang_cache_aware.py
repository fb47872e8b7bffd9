# SGLang's cache-aware routing policy, re-implemented in Python (strategy `sglang_cache_aware`).
#
# This is the peer our `prefix` strategy is measured against, so it follows SGLang's router
# (sgl-project/sglang, sgl-router: src/policies/cache_aware.rs and src/tree.rs) rule for rule,
# including its quirks, rather than improving on it. Written from a reading of those files.
#
# Algorithm, per request:
# 1. load(w) = requests the router has in flight to worker w (here: Replica.outstanding).
#    The pool is *imbalanced* when both (max_load - min_load) > balance_abs_threshold and
#    max_load > min_load * balance_rel_threshold. Then the least loaded worker (the first of
#    equals) takes the request, and the request text is still inserted under it. Reason "load".
# 2. Otherwise, match the request text in one approximate radix tree shared by all workers
#    (character-level, not tokens; each node remembers which workers ("tenants") hold it and
#    when each last touched it). Walking from the root, the match ends at the first differing
#    character, possibly inside a node; the worker chosen is the *first* tenant recorded on the
#    deepest node reached (SGLang takes the first entry of a hash map: arbitrary; here the
#    earliest-inserted still present). match_rate = matched chars / request chars.
#    If match_rate > cache_threshold, route there (reason "prefix"); else to the tenant with the
#    fewest characters in the tree ("most cache space left"; reason "cold"). Insert the text
#    under the chosen worker (new nodes, splits, access times up the path).
# 3. Eviction: every eviction_interval_secs, each tenant holding more than max_tree_size
#    characters loses its least recently used leaves (a min-heap of leaf access times; a parent
#    becomes a leaf when its last child for that tenant goes) until it is under the limit. SGLang
#    runs this in a background thread; here it runs inside `choose` once the interval has passed
#    (same effect for a router that is busy, no thread). The tree never learns what a worker
#    really evicted: between evictions it only grows.
#
# Settings and their defaults. SGLang has shipped several sets; we default to the one its
# current launcher applies (sgl-router/py_src/sglang_router/router_args.py, RouterArgs):
#   cache_threshold        0.3      (Rust CacheAwareConfig::default and older launchers: 0.5)
#   balance_abs_threshold  64       (Rust default and older launchers: 32)
#   balance_rel_threshold  1.5      (Rust default: 1.1; older launchers: 1.0001)
#   eviction_interval_secs 120      (Rust default: 30; older launchers: 60)
#   max_tree_size          2**26    characters per tenant (Rust default: 10000; older: 2**24)

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from routing.replica import Replica
from routing.router import RoutingDecision, RoutingRequest


def _common_prefix_len(a: str, b: str, b_start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[b_start:]`` (C-speed slice compares)."""
    n = min(len(a), len(b) - b_start)
    if a[:n] == b[b_start : b_start + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[b_start + lo : b_start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access time


class ApproxRadixTree:
    """SGLang's multi-tenant approximate radix tree over characters."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = _Node("", None)
        self.char_count: dict[str, int] = {}
        self.clock = clock

    def insert(self, text: str, tenant: str) -> None:
        now = self.clock()
        self.root.tenants[tenant] = now
        self.char_count.setdefault(tenant, 0)
        node, idx, n = self.root, 0, len(text)
        while idx < n:
            child = node.children.get(text[idx])
            if child is None:
                leaf = _Node(text[idx:], node)
                leaf.tenants[tenant] = now
                node.children[text[idx]] = leaf
                self.char_count[tenant] += n - idx
                return
            shared = _common_prefix_len(child.text, text, idx)
            if shared < len(child.text):
                # Split: node -> head (the shared part) -> child (the rest of its text).
                head = _Node(child.text[:shared], node)
                head.tenants = dict(child.tenants)
                child.text = child.text[shared:]
                child.parent = head
                head.children[child.text[0]] = child
                node.children[text[idx]] = head
                child = head
            if tenant not in child.tenants:
                self.char_count[tenant] += len(child.text)
            child.tenants[tenant] = now
            idx += shared
            node = child

    def prefix_match(self, text: str) -> tuple[int, str | None]:
        """(characters matched, the first tenant of the deepest node reached)."""
        node, idx, n = self.root, 0, len(text)
        while idx < n:
            child = node.children.get(text[idx])
            if child is None:
                break
            shared = _common_prefix_len(child.text, text, idx)
            idx += shared
            node = child
            if shared < len(child.text):
                break
        tenant = next(iter(node.tenants), None)
        if tenant is not None:
            now = self.clock()
            walk: _Node | None = node
            while walk is not None:
                walk.tenants[tenant] = now
                walk = walk.parent
        return idx, tenant

    def smallest_tenant(self) -> str | None:
        if not self.char_count:
            return None
        return min(self.char_count.items(), key=lambda kv: kv[1])[0]

    @staticmethod
    def _leaf_tenants(node: _Node) -> list[str]:
        below = {t for child in node.children.values() for t in child.tenants}
        return [t for t in node.tenants if t not in below]

    def evict_by_size(self, max_size: int) -> None:
        heap: list[tuple[float, int, str, _Node]] = []
        order = itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t in self._leaf_tenants(node):
                heap.append((node.tenants[t], next(order), t, node))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.char_count.get(tenant, 0) <= max_size:
                continue
            if tenant in node.tenants:
                self.char_count[tenant] = max(0, self.char_count[tenant] - len(node.text))
                del node.tenants[tenant]
            parent = node.parent
            if not node.children and not node.tenants and parent is not None and node.text:
                parent.children.pop(node.text[0], None)
            if parent is not None and tenant in self._leaf_tenants(parent):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def tenant_chars(self, tenant: str) -> int:
        return self.char_count.get(tenant, 0)


class SGLangCacheAwareRouter:
    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_secs: float = 120.0,
        max_tree_size: int = 2**26,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_secs = eviction_interval_secs
        self.max_tree_size = max_tree_size
        self.clock = clock
        self.trees: dict[str, ApproxRadixTree] = {}  # one per model, as in SGLang
        self._last_eviction = clock()

    def _tree(self, model: str, replicas: Sequence[Replica]) -> ApproxRadixTree:
        tree = self.trees.get(model)
        if tree is None:
            tree = self.trees[model] = ApproxRadixTree(self.clock)
        for r in replicas:  # SGLang registers each worker with an empty insert
            if r.name not in tree.char_count:
                tree.insert("", r.name)
        return tree

    def _maybe_evict(self) -> None:
        if self.eviction_interval_secs <= 0:
            return
        now = self.clock()
        if now - self._last_eviction >= self.eviction_interval_secs:
            self._last_eviction = now
            for tree in self.trees.values():
                tree.evict_by_size(self.max_tree_size)

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        if not replicas:
            return None
        self._maybe_evict()
        tree = self._tree(request.model, replicas)
        text = request.prompt_text
        loads = [r.outstanding for r in replicas]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > min_load * self.balance_rel_threshold
        ):
            chosen = replicas[loads.index(min_load)]
            tree.insert(text, chosen.name)
            return RoutingDecision(chosen, "load")
        matched, tenant = tree.prefix_match(text)
        rate = matched / len(text) if text else 0.0
        selected: str | None = tenant
        reason = "prefix"
        if rate <= self.cache_threshold or tenant is None:
            selected, reason = tree.smallest_tenant(), "cold"
        by_name = {r.name: r for r in replicas}
        chosen_or_none = by_name.get(selected) if selected is not None else None
        if chosen_or_none is None:
            # SGLang falls back to the first healthy worker and leaves the tree as it is.
            return RoutingDecision(replicas[0], "cold")
        tree.insert(text, chosen_or_none.name)
        return RoutingDecision(
            chosen_or_none,
            reason,
            matched_prefix=matched if reason == "prefix" else 0,
        )
