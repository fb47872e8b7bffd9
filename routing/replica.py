"""A replica is one upstream server (a vLLM instance or an external API endpoint).

Health has two inputs: active checks (the pool's checker calls vLLM's ``/health``) and passive
observations (each proxied request reports success or failure). ``eject_after`` consecutive
failures eject a replica; an active check that succeeds re-admits it. Replicas without active
checks (external APIs) are re-admitted after ``cooldown_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(eq=False)
class Replica:
    backend: str
    base_url: str  # OpenAI-style base URL, ending in /v1
    eject_after: int = 3
    cooldown_s: float = 10.0
    healthy: bool = True
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected_at: float | None = None
    last_error: str | None = None
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
    def root_url(self) -> str:
        """The server root: the base URL without its trailing ``/v1``."""
        if self.base_url.endswith("/v1"):
            return self.base_url[: -len("/v1")]
        return self.base_url

    def available(self, now: float | None = None) -> bool:
        if self.healthy:
            return True
        if self.ejected_at is None:
            return False
        # Passive-only replicas come back for a trial request after the cooldown.
        return (now if now is not None else time.monotonic()) - self.ejected_at >= self.cooldown_s

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.healthy = True
        self.ejected_at = None
        self.last_error = None

    def record_failure(self, reason: str) -> None:
        self.consecutive_failures += 1
        self.last_error = reason
        if self.consecutive_failures >= self.eject_after and self.healthy:
            self.healthy = False
            self.ejected_at = time.monotonic()

    def mark_down(self, reason: str) -> None:
        """An active check failed: take the replica out until a check succeeds."""
        self.healthy = False
        self.ejected_at = None
        self.last_error = reason


class LoadGuard:
    """Counts one outstanding request on a replica until released (idempotent)."""

    __slots__ = ("_released", "replica")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._released = False
        replica.outstanding += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.replica.outstanding -= 1
