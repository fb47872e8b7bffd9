"""GCRA (the generic cell rate algorithm) in exact integers: one rate limit, one key.

A limit of ``limit`` units per ``period_ms`` (requests or tokens per minute) is a bucket that
holds at most ``limit * period_ms`` of *debt* and drains ``limit`` per millisecond. Taking ``n``
units adds ``n * period_ms``; a take is admitted when the debt after it is at most the capacity,
otherwise nothing changes. So a tenant idle for a whole period may send the whole limit at
once, after which capacity comes back continuously, one unit every ``period_ms / limit`` ms.
This is GCRA's theoretical arrival time (TAT) stored as the debt ahead of now, ``(TAT - now) *
limit``, which keeps every quantity an integer: no float rounding ever decides an admission,
and the Lua copy in ``gateway.limits.lua`` computes exactly what this module computes (the
tests drive both with the same sequence and compare).

Guarantee: over any interval of ``t`` ms, the admitted units are at most
``limit + floor(t * limit / period_ms)``: a burst of ``limit`` from idle, then the rate. A burst
of concurrent requests therefore admits exactly ``limit`` (when it lasts less than one unit's
refill, ``period_ms / limit``). Token reservations are reconciled by ``adjust``: a positive
delta adds debt (which may exceed the capacity: the tenant waits it off), a negative one gives
capacity back, never below zero debt.

Range: quantities stay below 2**53 (Lua numbers are doubles) while ``limit * period_ms`` and a
single adjustment stay below it: up to 1e9 units per minute.
"""

from __future__ import annotations

from dataclasses import dataclass

PERIOD_MS = 60_000  # requests_per_minute, tokens_per_minute
MAX_LIMIT = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` units per ``period_ms``."""

    limit: int
    period_ms: int = PERIOD_MS

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_LIMIT or self.period_ms < 1:
            raise ValueError(f"a rate needs 1 <= limit <= {MAX_LIMIT} and period_ms >= 1")

    @property
    def capacity(self) -> int:
        return self.limit * self.period_ms


@dataclass(slots=True)
class Bucket:
    """The state of one key: its debt as of ``at_ms``."""

    debt: int = 0
    at_ms: int = 0


def debt_at(bucket: Bucket, rate: Rate, now_ms: int) -> int:
    """The debt left at ``now_ms``. A clock that went back drains nothing (never twice)."""
    elapsed = now_ms - bucket.at_ms
    if elapsed <= 0:
        return bucket.debt
    return max(0, bucket.debt - elapsed * rate.limit)


def wait_ms(debt: int, rate: Rate, amount: int) -> int | None:
    """Milliseconds until ``amount`` units fit; 0 if they fit now; None if they never can."""
    if amount > rate.limit:
        return None
    excess = debt + amount * rate.period_ms - rate.capacity
    return 0 if excess <= 0 else -(-excess // rate.limit)


def remaining(debt: int, rate: Rate) -> int:
    """Whole units that could be taken now."""
    return max(0, (rate.capacity - debt) // rate.period_ms)


def reset_ms(debt: int, rate: Rate) -> int:
    """Milliseconds until the bucket is back to its full limit."""
    return -(-debt // rate.limit)


def take(bucket: Bucket, rate: Rate, amount: int, now_ms: int) -> int | None:
    """Take ``amount`` units if they fit: returns the wait (0: taken; >0 or None: refused)."""
    debt = debt_at(bucket, rate, now_ms)
    wait = wait_ms(debt, rate, amount)
    if wait == 0:
        bucket.debt = debt + amount * rate.period_ms
        bucket.at_ms = max(bucket.at_ms, now_ms)
    return wait


def adjust(bucket: Bucket, rate: Rate, delta: int, now_ms: int) -> None:
    """Reconcile a reservation: ``delta`` units more (used beyond the estimate) or fewer."""
    bucket.debt = max(0, debt_at(bucket, rate, now_ms) + delta * rate.period_ms)
    bucket.at_ms = max(bucket.at_ms, now_ms)
