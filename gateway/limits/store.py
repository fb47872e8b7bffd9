"""What a limit store does, key by key: the same contract in memory and in Redis.

One ``acquire`` checks every rule of a request at once and either takes all of them or none:
the budget gate, the GCRA buckets (requests, tokens; per tenant and per tenant on a surface)
and the concurrency slots. One ``settle`` ends the request: it reconciles the token buckets
with the real usage, releases the slot leases and the budget hold, and adds the usage to the
tenant's window records, returning each record's new spend (alerts fire on the crossing, so
exactly once).

A budgeted request holds its worst-case cost (``Hold``) from its admission to its settlement,
so a burst cannot pass a budget by what its answers cost before they settle: the gate admits
only while ``spend + held + hold <= cap``. The holds of a window are a sorted set beside its
usage record (``<record>:h``), each member ``<id>=<micro-dollars>`` scored by its expiry, and
their total is the record's ``held$`` field. A hold expires as a concurrency lease does (its
holder renews it): the next check of the budget reclaims the holds of a crashed instance. A
hold is released at most once (the member is removed, and only then is its amount taken off
the total), so a settlement resent after a lost answer cannot release it twice.

Money fields of a usage record end in ``$`` and are pUSD (``gateway.limits.cost``).
A store that cannot answer raises ``StoreUnavailable``; the limiter decides what that means.
One call the store could not run (``ScriptError``: a bug, or an input it cannot take) fails
that call alone: the store stays available to every other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.limits.gcra import Rate

SPEND = "spend$"  # the usage record's total, in pUSD
HELD = "held$"  # pUSD held by the budgeted requests in flight (``Hold``)
MICRO = 10**6  # pUSD per micro-dollar: a hold is a whole number of them


@dataclass(slots=True)
class LimitCounts:
    """What the limiters and their stores counted in this process, handed from a limiter to
    the one a reload builds for a new store, so ``/metrics`` never sees a total go back."""

    granted: int = 0  # requests admitted from a grant
    unavailable: dict[str, int] = field(default_factory=dict)  # direction (open, closed) -> n
    alerts: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (tenant, window, %)
    undos_dropped: int = 0  # undos of lost Redis checks dropped past ``MAX_UNDOS``
    # usage records never written, by why: ``script_error``, ``pending_full`` (the ledger's)
    records_lost: dict[str, int] = field(default_factory=dict)


class StoreUnavailable(Exception):
    """The shared store did not answer (down, slow, or in its back-off window).

    ``maybe_applied``: the call was sent and may have run before the answer was lost.
    """

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class ScriptError(StoreUnavailable):
    """The store failed this one call (a script error: a bug of ours or an input it cannot
    take), not for want of the store: the caller answers as if it were unavailable, for this
    call only, and sending it again would fail again."""


@dataclass(frozen=True, slots=True)
class BucketTake:
    key: str
    rate: Rate
    amount: int


@dataclass(frozen=True, slots=True)
class SlotTake:
    key: str
    limit: int  # leases held at once
    count: int = 1  # leases this take adds: more than one is a grant (``lease_ids``)


def lease_ids(lease_id: str, count: int) -> list[str]:
    """The members a take of ``count`` slots adds: the lease id itself when one, else
    ``<lease id>#0`` ... ``#count-1`` (the first is the asking request's, the rest a grant's)."""
    return [lease_id] if count == 1 else [f"{lease_id}#{n}" for n in range(count)]


@dataclass(frozen=True, slots=True)
class Hold:
    """A budgeted request's worst-case cost, held in its budget's window until it settles."""

    record: str  # the window's usage record (its ``held$`` field is the total held)
    id: str
    amount: int  # pUSD, a whole number of micro-dollars (rounded up: never less than the cost)

    @classmethod
    def of(cls, record: str, hold_id: str, amount: int) -> Hold:
        return cls(record, hold_id, -(-amount // MICRO) * MICRO)

    @property
    def key(self) -> str:
        """The window's hold set: members scored by their expiry (ms), renewed as leases are."""
        return self.record + ":h"

    @property
    def member(self) -> str:
        return f"{self.id}={self.amount // MICRO}"


def held_amount(member: str) -> int:
    """The pUSD a hold set's member holds."""
    return int(member.rpartition("=")[2]) * MICRO


@dataclass(frozen=True, slots=True)
class BudgetGate:
    key: str  # the usage record of the budget's current window
    cap: int  # pUSD
    refuse: bool  # refuse what the budget cannot cover (on_exhausted: reject); else report it
    hold: Hold | None = None  # taken when the budget covers it (``hold.record == key``)
    keep_s: int = 0  # the record's lifetime, should the hold be the first to write it


@dataclass(frozen=True, slots=True)
class AcquireRequest:
    buckets: tuple[BucketTake, ...]
    slots: tuple[SlotTake, ...] = ()
    budget: BudgetGate | None = None
    lease_id: str = ""
    lease_ttl_ms: int = 30_000
    now_ms: int | None = None  # None: the store's own clock (Redis: TIME, one clock for all)


Blocker = Literal["bucket", "slot", "budget"]


@dataclass(frozen=True, slots=True)
class AcquireResult:
    admitted: bool
    now_ms: int
    debts: tuple[int, ...]  # per bucket: after the take if admitted, else as found
    held: tuple[int, ...]  # per slot: leases held, after the take if admitted
    spend: int  # pUSD in the budget's record (0 without a budget gate)
    blocked_by: Blocker | None = None
    blocked_index: int = 0  # which bucket or slot
    wait_ms: int | None = 0  # a refused bucket: until it fits; None: never (amount > limit)
    # The budget cannot cover the request: spent, or spend + held + hold > cap (refused when
    # the gate refuses, else admitted without a hold: the downgrade).
    over_budget: bool = False
    budget_held: int = 0  # pUSD held in the budget's window, the request's hold included


@dataclass(frozen=True, slots=True)
class BucketAdjust:
    key: str
    rate: Rate
    delta: int  # units: used minus reserved


@dataclass(frozen=True, slots=True)
class UsageAdd:
    key: str
    keep_s: int  # the record's lifetime (its window's end plus one window)
    fields: tuple[tuple[str, int], ...]  # must include SPEND


@dataclass(frozen=True, slots=True)
class SettleRequest:
    adjusts: tuple[BucketAdjust, ...] = ()
    releases: tuple[str, ...] = ()  # slot keys holding lease_id
    lease_id: str = ""  # one lease id, or several separated by spaces (a grant's unused ones)
    usage: tuple[UsageAdd, ...] = ()
    now_ms: int | None = None
    holds: tuple[Hold, ...] = ()  # released before the usage is added, in the same step
    # Sent again after an answer was lost, a settlement with an id runs at most once: the
    # store keeps ``done_key`` for an hour (one key per settled request: a day held 8.6 M keys
    # at 100 req/s). Without one (the memory store never loses answers) it simply runs.
    id: str = ""
    done_key: str = ""


class LimitStore(Protocol):
    """``kind`` is ``memory`` (one instance) or ``redis`` (shared by every instance)."""

    kind: Literal["memory", "redis"]

    async def acquire(self, req: AcquireRequest) -> AcquireResult:
        """All of ``req`` or none. A caller cancelled while waiting takes none either, nor does
        a call that fails having perhaps run (``StoreUnavailable.maybe_applied``: a time-out,
        a lost connection): what the store admitted all the same is given back (memory: an
        acquire never waits, so a caller cannot leave in the middle; Redis: exactly once, when
        the lost reply comes or Redis answers again)."""
        ...

    async def settle(self, req: SettleRequest) -> tuple[int, ...] | None:
        """The new SPEND of each usage record, in order; None if ``id`` had already run."""
        ...

    async def renew(
        self, leases: tuple[tuple[str, str], ...], ttl_ms: int, now_ms: int | None
    ) -> None:
        """Extend each (slot key, lease id) still held to ``ttl_ms`` from now (a hold is
        renewed as one: ``(hold.key, hold.member)``)."""
        ...

    async def read_usage(self, key: str, now_ms: int | None = None) -> dict[str, int]:
        """The record's fields at ``now_ms``; ``HELD``: what the holds still live hold."""
        ...

    def on_trouble(self, react: Callable[[], None]) -> None:
        """Call ``react`` as soon as the store may have become unavailable."""
        ...

    async def aclose(self) -> None: ...
