"""Warnings that repeat per request, told at most once per key and period.

A dead replica under load fails every request sent to it, and a collector that is down fails
every export: a line per event would bury everything else in the log at the hour it is read.
``LogEvery`` writes the first line of a key at once, then at most one every ``period_s``, and
that line says how many like it were left out since the last one. Counts stay in the metrics;
the log tells that it happens, and where.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024  # keys (replicas x outcomes) remembered; past this the oldest are forgotten


class LogEvery:
    __slots__ = ("_clock", "_log", "_period_s", "_seen")

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._period_s = period_s
        self._clock = clock
        self._seen: dict[Hashable, list[float]] = {}  # key -> [last written, left out since]

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``period_s`` ago; True if
        the line was written."""
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._period_s:
            seen[1] += 1
            return False
        left_out = int(seen[1]) if seen is not None else 0
        if seen is None and len(self._seen) >= MAX_KEYS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = [now, 0.0]
        if left_out:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, left_out, now - seen[0]) if seen is not None else args
        self._log.warning(msg, *args)
        return True
