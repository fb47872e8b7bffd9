"""What external APIs say of their rate limits, and pacing requests by it.

Every answer of a replica (any status) is read for what its provider says is left:

* OpenAI (and compatible APIs): ``x-ratelimit-remaining-requests`` / ``-tokens`` with
  ``x-ratelimit-reset-requests`` / ``-tokens``, durations such as ``1s``, ``6m0s``, ``20ms``;
* Anthropic: ``anthropic-ratelimit-requests-remaining`` / ``-tokens-remaining`` (also
  ``-input-tokens-``, ``-output-tokens-``) with ``...-reset``, RFC 3339 times;
* a 429's ``retry-after`` (seconds, or an HTTP date) or ``retry-after-ms``.

State is kept per replica (an external API is one replica: its key's limits are the account's)
and bounded by the policy's replicas. Pacing: before a request is sent to a replica whose last
answer said a budget is spent (no request left, or fewer tokens than this request may use) or
whose 429 asked to wait, ``wait_s`` says how long until it resets. The attempt opener waits
that long if it is within the backend's ``rate_limit_wait_s`` (and the request's deadline),
else goes to the next target at once; the time waited is recorded apart from model latency.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def duration_s(text: str) -> float | None:
    """OpenAI's ``6m0s``, ``1.5s``, ``20ms``; a bare number is seconds."""
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _until(value: str, now_wall: float) -> float | None:
    """Seconds until an RFC 3339 time or an HTTP date; or a duration / seconds."""
    seconds = duration_s(value)
    if seconds is not None:
        return seconds
    try:
        at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        try:
            at = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
    return max(0.0, at.timestamp() - now_wall)


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        seconds = duration_s(ms)
        if seconds is not None:
            return seconds / 1000
    value = headers.get("retry-after")
    return _until(value, time.time()) if value is not None else None


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


@dataclass(slots=True)
class _Budget:
    remaining: int
    reset_at: float  # monotonic


class ProviderLimits:
    """One replica's rate limit state, as its last answers reported it."""

    __slots__ = ("_blocked_until", "_requests", "_tokens")

    def __init__(self) -> None:
        self._requests: _Budget | None = None
        self._tokens: _Budget | None = None
        self._blocked_until = 0.0

    def observe(self, headers: Mapping[str, str], status: int, now: float) -> None:
        wall = time.time()
        for kind in ("requests", "tokens"):
            remaining = _int(headers.get(f"x-ratelimit-remaining-{kind}"))
            reset = headers.get(f"x-ratelimit-reset-{kind}")
            if remaining is None:
                remaining = _int(headers.get(f"anthropic-ratelimit-{kind}-remaining"))
                reset = headers.get(f"anthropic-ratelimit-{kind}-reset")
            if remaining is None:
                continue
            wait = _until(reset, wall) if reset is not None else None
            budget = _Budget(remaining, now + (wait if wait is not None else 1.0))
            if kind == "requests":
                self._requests = budget
            else:
                self._tokens = budget
        if status == 429:
            wait = retry_after_s(headers)
            self._blocked_until = max(
                self._blocked_until, now + (wait if wait is not None else 1.0)
            )

    def wait_s(self, tokens: int, now: float) -> float:
        """How long a request needing ``tokens`` should wait before it is sent (0: go)."""
        wait = max(0.0, self._blocked_until - now)
        if self._requests is not None and self._requests.remaining <= 0:
            wait = max(wait, self._requests.reset_at - now)
        if self._tokens is not None and self._tokens.remaining < max(tokens, 1):
            wait = max(wait, self._tokens.reset_at - now)
        return max(0.0, wait)


class UpstreamLimits:
    """Every replica's ``ProviderLimits``, by base URL (replicas come from the policy)."""

    def __init__(self) -> None:
        self._by_url: dict[str, ProviderLimits] = {}

    def observe(self, url: str, headers: Mapping[str, str], status: int) -> None:
        if status == 429 or any(_reports(name) for name in headers):
            limits = self._by_url.get(url)
            if limits is None:
                limits = self._by_url[url] = ProviderLimits()
            limits.observe(headers, status, time.monotonic())

    def wait_s(self, url: str, tokens: Callable[[], int]) -> float:
        """``tokens``: what the request may use (estimated only for a replica with a state)."""
        limits = self._by_url.get(url)
        return 0.0 if limits is None else limits.wait_s(tokens(), time.monotonic())


def _reports(name: str) -> bool:
    lower = name.lower()
    return lower.startswith(("x-ratelimit-remaining", "anthropic-ratelimit-"))
