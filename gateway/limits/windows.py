"""Budget windows: calendar-aligned in UTC.

* ``day``: from 00:00 UTC to the next 00:00 UTC;
* ``week``: from Monday 00:00 UTC (ISO 8601 weeks) to the next Monday;
* ``month``: from the 1st 00:00 UTC to the 1st of the next month.

A window's id names its first day (``d2026-11-23``, ``w2026-11-23``, ``m2026-11``), so every
gateway instance computes the same id for the same instant, and a new window is simply a new
key: spend starts again from zero with nothing to reset. Instances read their own clocks here;
a skew between them matters only within that skew of midnight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

WindowKind = Literal["day", "week", "month"]
WINDOW_KINDS: tuple[WindowKind, ...] = ("day", "week", "month")


@dataclass(frozen=True, slots=True)
class Window:
    kind: WindowKind
    start: datetime
    end: datetime
    id: str = field(init=False)

    def __post_init__(self) -> None:
        ident = (
            f"m{self.start:%Y-%m}"
            if self.kind == "month"
            else (f"{self.kind[0]}{self.start:%Y-%m-%d}")
        )
        object.__setattr__(self, "id", ident)

    def seconds_left(self, now_s: float) -> float:
        return max(0.0, self.end.timestamp() - now_s)

    def keep_s(self, now_s: float) -> int:
        """How long a window's record is kept: to its end, and one window more (for reports)."""
        length = (self.end - self.start).total_seconds()
        return int(self.seconds_left(now_s) + length) + 1


_SEEN: dict[tuple[WindowKind, int], Window] = {}  # by kind and UTC day: every request asks


def window_of(kind: WindowKind, now_s: float) -> Window:
    """The window of ``kind`` holding the instant ``now_s`` (Unix seconds)."""
    key = (kind, int(now_s // 86_400))
    found = _SEEN.get(key)
    if found is None:
        if len(_SEEN) > 64:
            _SEEN.clear()
        found = _SEEN[key] = _window_of(kind, now_s)
    return found


def _window_of(kind: WindowKind, now_s: float) -> Window:
    now = datetime.fromtimestamp(now_s, UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "day":
        return Window(kind, day, day + timedelta(days=1))
    if kind == "week":
        start = day - timedelta(days=day.weekday())
        return Window(kind, start, start + timedelta(days=7))
    start = day.replace(day=1)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else (start.replace(month=start.month + 1))
    )
    return Window(kind, start, end)
