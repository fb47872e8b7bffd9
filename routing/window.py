"""A rolling latency histogram: O(1) per observation, percentiles over the last ``window_s``.

Values (milliseconds) fall into fixed log-spaced buckets (each ``growth`` times wider than the
last, from ``min_ms`` up), so a percentile read from a bucket's geometric middle is within
about half the growth (5% at 1.1) of the true value. Time is cut into ``slots`` equal slices;
each slot has its own counts and is cleared when the ring comes back to it, so the window
slides by one slot at a time. Reading a percentile sums the live slots (slots x buckets
additions): meant for scrapes and for callers that cache the result, not for every chunk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class RollingHistogram:
    __slots__ = (
        "_clock",
        "_counts",
        "_epochs",
        "_log_growth",
        "_max_seen",
        "_slot_s",
        "buckets",
        "growth",
        "min_ms",
        "slots",
        "window_s",
    )

    def __init__(
        self,
        window_s: float = 300.0,
        *,
        slots: int = 10,
        min_ms: float = 0.1,
        max_ms: float = 3_600_000.0,
        growth: float = 1.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or slots < 1 or min_ms <= 0 or max_ms <= min_ms or growth <= 1:
            raise ValueError("window_s, slots, min_ms < max_ms and growth > 1 must be positive")
        self.window_s = window_s
        self.slots = slots
        self.min_ms = min_ms
        self.growth = growth
        self._log_growth = math.log(growth)
        # Bucket 0 holds values below min_ms; bucket i >= 1 holds [min * g^(i-1), min * g^i).
        self.buckets = 2 + math.ceil(math.log(max_ms / min_ms) / self._log_growth)
        self._slot_s = window_s / slots
        self._counts = [[0] * self.buckets for _ in range(slots)]
        self._epochs = [-1] * slots
        self._clock = clock
        self._max_seen = 0.0

    def _bucket(self, value_ms: float) -> int:
        if value_ms < self.min_ms:
            return 0
        i = 1 + int(math.log(value_ms / self.min_ms) / self._log_growth)
        return min(i, self.buckets - 1)

    def observe(self, value_ms: float) -> None:
        epoch = int(self._clock() / self._slot_s)
        k = epoch % self.slots
        if self._epochs[k] != epoch:
            self._epochs[k] = epoch
            row = self._counts[k]
            for i in range(self.buckets):
                row[i] = 0
        self._counts[k][self._bucket(value_ms)] += 1
        if value_ms > self._max_seen:
            self._max_seen = value_ms

    def merged(self) -> list[int]:
        """Counts per bucket over the live window."""
        oldest = int(self._clock() / self._slot_s) - self.slots + 1
        total = [0] * self.buckets
        for k in range(self.slots):
            if self._epochs[k] >= oldest:
                for i, c in enumerate(self._counts[k]):
                    if c:
                        total[i] += c
        return total

    def count(self) -> int:
        return sum(self.merged())

    def quantile(self, q: float, counts: list[int] | None = None) -> float | None:
        """The ``q`` quantile (0 < q <= 1) in milliseconds; None without observations."""
        counts = self.merged() if counts is None else counts
        n = sum(counts)
        if n == 0:
            return None
        rank = max(1, math.ceil(q * n))
        seen = 0
        for i, c in enumerate(counts):
            seen += c
            if seen >= rank:
                return self._value(i)
        return self._value(self.buckets - 1)

    def quantile_above(
        self, q: float, floor_ms: float, counts: list[int] | None = None
    ) -> float | None:
        """The ``q`` quantile of the values above ``floor_ms``; None if none lie above it."""
        counts = self.merged() if counts is None else counts
        start = self._bucket(floor_ms) + 1
        above = counts[start:]
        n = sum(above)
        if n == 0:
            return None
        rank = max(1, math.ceil(q * n))
        seen = 0
        for j, c in enumerate(above):
            seen += c
            if seen >= rank:
                return self._value(start + j)
        return self._value(self.buckets - 1)

    def _value(self, i: int) -> float:
        if i == 0:
            return self.min_ms / 2
        low = self.min_ms * self.growth ** (i - 1)
        return min(low * math.sqrt(self.growth), max(self._max_seen, low))


class RollingCounts:
    """A few counters over the last ``window_s`` (same slot ring as ``RollingHistogram``)."""

    __slots__ = ("_clock", "_counts", "_epochs", "_slot_s", "fields", "slots", "window_s")

    def __init__(
        self,
        fields: int,
        window_s: float = 300.0,
        *,
        slots: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fields < 1 or window_s <= 0 or slots < 1:
            raise ValueError("fields, window_s and slots must be positive")
        self.fields = fields
        self.window_s = window_s
        self.slots = slots
        self._slot_s = window_s / slots
        self._counts = [[0] * fields for _ in range(slots)]
        self._epochs = [-1] * slots
        self._clock = clock

    def add(self, field: int, n: int = 1) -> None:
        epoch = int(self._clock() / self._slot_s)
        k = epoch % self.slots
        if self._epochs[k] != epoch:
            self._epochs[k] = epoch
            self._counts[k] = [0] * self.fields
        self._counts[k][field] += n

    def totals(self) -> list[int]:
        oldest = int(self._clock() / self._slot_s) - self.slots + 1
        total = [0] * self.fields
        for k in range(self.slots):
            if self._epochs[k] >= oldest:
                for i, c in enumerate(self._counts[k]):
                    total[i] += c
        return total
