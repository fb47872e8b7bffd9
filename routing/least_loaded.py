"""Least outstanding requests, ties broken by rotation so idle replicas share new work."""

from __future__ import annotations

from collections.abc import Sequence

from routing.replica import Replica
from routing.router import RoutingDecision, RoutingRequest


class LeastLoadedRouter:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        if not replicas:
            return None
        self._turn += 1
        n = len(replicas)
        best: Replica | None = None
        for i in range(n):
            r = replicas[(self._turn + i) % n]
            if best is None or r.outstanding < best.outstanding:
                best = r
        assert best is not None
        return RoutingDecision(replica=best, reason="least_loaded")


class RoundRobinRouter:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        if not replicas:
            return None
        self._turn += 1
        return RoutingDecision(replica=replicas[self._turn % len(replicas)], reason="round_robin")
