"""Load of a replica, and the bounded-load rule that lets cache affinity yield.

``load(r) = max(r.outstanding, r.running + r.waiting)``: the gateway's own in-flight count is
exact and fresh; vLLM's scraped queue counts (``vllm:num_requests_running`` and ``_waiting``)
are up to one scrape interval old but also see requests sent by other gateway instances. The
larger of the two is the better estimate of both.

A replica is *overloaded* for the request being placed when any of these holds:

- relative (bounded load, as in consistent hashing with bounded loads, Mirrokni et al. 2018):
  ``load(r) + 1 > (1 + epsilon) * (total_load + 1) / n + slack``; with the request placed, no
  replica may carry more than ``1 + epsilon`` times the mean. ``slack`` (requests) keeps the
  rule from flapping while the pool is nearly idle, where a few requests of difference cost
  nothing (a GPU batches them). Routers may apply it to loads smoothed over ``smoothing_s``
  (``SmoothedLoads``) so that only sustained imbalance moves prefixes; then the test is
  ``smoothed(r) > (1 + epsilon) * mean(smoothed) + slack`` (no +1: an average does not step);
- absolute: ``r.waiting > max_waiting`` (vLLM is queueing: its running batch is full), or
  ``r.kv_usage >= max_kv_usage`` (its KV cache is nearly full: admitting more causes
  preemption, which throws cached prefixes away anyway).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from routing.replica import Replica


@dataclass(frozen=True, slots=True)
class BalanceSettings:
    epsilon: float = 0.25
    slack: float = 1.0
    max_waiting: int | None = 0
    max_kv_usage: float | None = 0.95


def replica_load(replica: Replica) -> float:
    if replica.running is None and replica.waiting is None:
        return float(replica.outstanding)
    scraped = (replica.running or 0.0) + (replica.waiting or 0.0)
    return max(float(replica.outstanding), scraped)


class SmoothedLoads:
    """Exponentially smoothed load per replica (time constant ``tau_s``).

    The relative bound acts on these: a burst of arrivals that lifts one replica above the
    mean for a second is not worth moving a prefix (every move is a full prefill elsewhere);
    a replica that stays above it (a hot prefix) is.
    """

    def __init__(self, tau_s: float, clock: Callable[[], float]) -> None:
        self.tau_s = tau_s
        self.clock = clock
        self._value: dict[str, float] = {}
        self._at: float | None = None

    def update(
        self, replicas: Sequence[Replica], loads: Sequence[float], *, keep: bool = True
    ) -> list[float]:
        """The smoothed loads with ``loads`` taken in; kept unless ``keep`` is False (a router
        asked where it would send a request, not sending it)."""
        now = self.clock()
        if self.tau_s <= 0 or self._at is None:
            alpha = 1.0
        else:
            alpha = 1.0 - math.exp(-max(now - self._at, 0.0) / self.tau_s)
        out: list[float] = []
        for r, load in zip(replicas, loads, strict=True):
            old = self._value.get(r.name)
            out.append(load if old is None else old + alpha * (load - old))
        if keep:
            self._at = now
            self._value.update(zip((r.name for r in replicas), out, strict=True))
        return out


class LoadView:
    """Loads of one set of replicas, computed once per routing decision."""

    __slots__ = ("_bound", "_extra", "_relative", "loads", "settings")

    def __init__(
        self,
        replicas: Sequence[Replica],
        settings: BalanceSettings,
        smoothed: SmoothedLoads | None = None,
        keep: bool = True,  # False: the smoothed loads are read, not updated
    ) -> None:
        self.settings = settings
        self.loads = [replica_load(r) for r in replicas]
        if smoothed is None:
            # Instantaneous: count the request being placed (Mirrokni's bound).
            self._relative, self._extra = self.loads, 1.0
        else:
            # Smoothed loads are averages over time: one more request is not a step in them.
            self._relative, self._extra = smoothed.update(replicas, self.loads, keep=keep), 0.0
        n = max(len(self.loads), 1)
        total = sum(self._relative) + self._extra
        self._bound = (1.0 + settings.epsilon) * total / n + settings.slack

    def overloaded(self, index: int, replica: Replica) -> bool:
        s = self.settings
        if self._relative[index] + self._extra > self._bound:
            return True
        if s.max_waiting is not None and (replica.waiting or 0.0) > s.max_waiting:
            return True
        return s.max_kv_usage is not None and (replica.kv_usage or 0.0) >= s.max_kv_usage


def least_loaded_index(loads: Sequence[float], candidates: Sequence[int], turn: int) -> int:
    """The least loaded of ``candidates`` (indices), ties rotated by ``turn``."""
    n = len(candidates)
    best = candidates[turn % n]
    for k in range(1, n):
        i = candidates[(turn + k) % n]
        if loads[i] < loads[best]:
            best = i
    return best
