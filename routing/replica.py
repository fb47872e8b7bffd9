"""A replica is one upstream server (a vLLM instance or an external API endpoint).

Health has two inputs: active checks (the pool's checker calls vLLM's ``/health``) and passive
observations (each proxied request reports success or failure). ``eject_after`` consecutive
failures eject a replica; an active check that succeeds re-admits it.

Without a passing check to re-admit it, an ejected replica is a circuit breaker: after its
cooldown it is half-open and takes one trial request at a time (``outstanding == 0``). A
trial that succeeds closes it (healthy again, cooldown back to ``cooldown_s``); a trial that
fails ejects it again at once, for twice the last cooldown, at most ``MAX_BACKOFF`` times
``cooldown_s``. A failure that arrives during the cooldown (a request sent before the
ejection) changes nothing. A (replica, model) pair of an external API is ejected and tried
again the same way (without the one-at-a-time bound: load is counted per replica).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_BACKOFF = 8  # a failed trial doubles the cooldown, up to this many times cooldown_s


@dataclass(eq=False, slots=True, weakref_slot=True)
class InFlight:
    """Requests in flight to one replica (its URL) through one backend's pools: a reload's new
    pool shares the count of the pools still draining there (``routing.pool.ReplicaStates``),
    so the replica's load, and what admission allows, hold across it."""

    n: int = 0


@dataclass(eq=False)
class Replica:
    backend: str
    base_url: str  # OpenAI-style base URL, ending in /v1
    eject_after: int = 3
    cooldown_s: float = 10.0
    healthy: bool = True
    in_flight: InFlight = field(default_factory=InFlight, repr=False)
    own: int = 0  # of ``outstanding``, the requests sent through this pool (what a drain awaits)
    consecutive_failures: int = 0
    ejected_at: float | None = None
    ejected_for: float = 0.0  # the cooldown of the current ejection (doubles on a failed trial)
    last_error: str | None = None
    # One replica serving many models (an external API: kind openai or anthropic): answers
    # that fail for one model (5xx, time-outs) eject that (replica, model) pair only; a
    # connection error still ejects the replica.
    per_model: bool = False
    _models: dict[str, _ModelHealth] = field(default_factory=dict, repr=False, init=False)
    # Load reported by the replica itself (vLLM /metrics); None until scraped.
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        self.name = parts.netloc or self.base_url

    @property
    def outstanding(self) -> int:
        """Requests in flight to this replica, through any pool (a replaced one included)."""
        return self.in_flight.n

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        self.in_flight.n = value

    @property
    def root_url(self) -> str:
        """The server root: the base URL without its trailing ``/v1``."""
        if self.base_url.endswith("/v1"):
            return self.base_url[: -len("/v1")]
        return self.base_url

    def available(self, now: float | None = None, model: str | None = None) -> bool:
        now = now if now is not None else time.monotonic()
        if model is not None and self._models:
            pair = self._models.get(model)
            if (
                pair is not None
                and pair.ejected_at is not None
                and now - pair.ejected_at < pair.ejected_for
            ):
                return False
        if self.healthy:
            return True
        if self.ejected_at is None:
            return False  # an active check took it out: only a passing check re-admits it
        # Half-open after the cooldown: one trial request at a time.
        return now - self.ejected_at >= self.ejected_for and self.outstanding == 0

    def record_success(self, model: str | None = None) -> None:
        self.consecutive_failures = 0
        self.healthy = True
        self.ejected_at = None
        self.last_error = None
        if model is not None and self._models:
            self._models.pop(model, None)

    def record_failure(self, reason: str, model: str | None = None) -> None:
        """One failed attempt; ``model``: it failed for that model only (a 5xx, a time-out)."""
        self.last_error = reason
        now = time.monotonic()
        if self.per_model and model is not None:
            pair = self._models.setdefault(model, _ModelHealth())
            pair.failures += 1
            if pair.ejected_at is None:
                if pair.failures >= self.eject_after:
                    pair.ejected_at, pair.ejected_for = now, self.cooldown_s
            elif now - pair.ejected_at >= pair.ejected_for:  # a failed trial
                pair.ejected_at, pair.ejected_for = now, self._longer(pair.ejected_for)
            return
        self.consecutive_failures += 1
        if self.healthy:
            if self.consecutive_failures >= self.eject_after:
                self.healthy = False
                self.ejected_at, self.ejected_for = now, self.cooldown_s
        elif self.ejected_at is not None and now - self.ejected_at >= self.ejected_for:
            self.ejected_at, self.ejected_for = now, self._longer(self.ejected_for)

    def _longer(self, cooldown: float) -> float:
        return min(cooldown * 2, self.cooldown_s * MAX_BACKOFF)

    def mark_down(self, reason: str) -> None:
        """An active check failed: take the replica out until a check succeeds."""
        self.healthy = False
        self.ejected_at = None
        self.last_error = reason


@dataclass(slots=True)
class _ModelHealth:
    failures: int = 0
    ejected_at: float | None = None
    ejected_for: float = 0.0


class LoadGuard:
    """Counts one outstanding request on a replica until released (idempotent)."""

    __slots__ = ("_released", "replica")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._released = False
        replica.in_flight.n += 1
        replica.own += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.replica.in_flight.n -= 1
            self.replica.own -= 1
