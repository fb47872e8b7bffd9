"""Session affinity by consistent hashing (strategy ``session``).

The key is the request's ``session_key`` when the caller sends one, else the tenant plus the
first ``prefix_chars`` characters of the routing text (so a conversation's turns, which share
their beginning, hash alike). Keys and replicas sit on a hash ring (``virtual_nodes`` points per
replica, blake2b, stable across processes and gateway instances); a key goes to the first
replica point clockwise from it. When a replica leaves, only its keys move; when one joins, it
takes about 1/n of the keys.

The ring knows nothing of load or of what a replica's cache holds. With ``bounded_load_epsilon``
set (off by default: the plain-hashing baseline), a key walks on past replicas whose load
exceeds ``(1 + epsilon) x mean`` (consistent hashing with bounded loads, Mirrokni et al. 2018).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from hashlib import blake2b

from routing.load import BalanceSettings, LoadView
from routing.replica import Replica
from routing.router import RoutingDecision, RoutingRequest


def _point(data: str) -> int:
    return int.from_bytes(blake2b(data.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: Sequence[str], virtual_nodes: int) -> None:
        points = sorted(
            (_point(f"{name}#{v}"), name) for name in names for v in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._names = [name for _, name in points]
        self._distinct = len(set(names))

    def walk(self, key: str) -> list[str]:
        """Replica names in ring order starting at ``key``'s position, each once."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, _point(key)) % len(self._hashes)
        seen: list[str] = []
        for k in range(len(self._names)):
            name = self._names[(start + k) % len(self._names)]
            if name not in seen:
                seen.append(name)
                if len(seen) == self._distinct:
                    break
        return seen


class SessionRouter:
    def __init__(
        self,
        virtual_nodes: int = 160,
        prefix_chars: int = 256,
        bounded_load_epsilon: float | None = None,
    ) -> None:
        self.virtual_nodes = virtual_nodes
        self.prefix_chars = prefix_chars
        self.balance = (
            None
            if bounded_load_epsilon is None
            else BalanceSettings(
                epsilon=bounded_load_epsilon, slack=1.0, max_waiting=None, max_kv_usage=None
            )
        )
        self._rings: dict[tuple[str, ...], HashRing] = {}

    def _ring(self, replicas: Sequence[Replica]) -> HashRing:
        names = tuple(sorted(r.name for r in replicas))
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) > 64:  # membership churn: keep the cache small
                self._rings.clear()
            ring = self._rings[names] = HashRing(names, self.virtual_nodes)
        return ring

    def key(self, request: RoutingRequest) -> str:
        if request.session_key:
            return f"s:{request.session_key}"
        return f"t:{request.tenant}:{request.prompt_text[: self.prefix_chars]}"

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        if not replicas:
            return None
        by_name = {r.name: (i, r) for i, r in enumerate(replicas)}
        order = self._ring(replicas).walk(self.key(request))
        chosen = by_name[order[0]][1]
        reason = "session"
        if self.balance is not None:
            view = LoadView(replicas, self.balance)
            for steps, name in enumerate(order):
                j, r = by_name[name]
                if not view.overloaded(j, r):
                    chosen = r
                    reason = "session" if steps == 0 else "load"
                    break
        return RoutingDecision(replica=chosen, reason=reason)
