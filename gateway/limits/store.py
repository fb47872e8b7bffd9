"""What a limit store does, key by key: the same contract in memory and in Redis.

One ``acquire`` checks every rule of a request at once and either takes all of them or none:
the budget gate, the GCRA buckets (requests, tokens; per tenant and per tenant on a surface)
and the concurrency slots. One ``settle`` ends the request: it reconciles the token buckets
with the real usage, releases the slot leases and adds the usage to the tenant's window
records, returning each record's new spend (alerts fire on the crossing, so exactly once).

Money fields of a usage record end in ``$`` and are pUSD (``gateway.limits.cost``).
A store that cannot answer raises ``StoreUnavailable``; the limiter decides what that means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.limits.gcra import Rate

SPEND = "spend$"  # the usage record's total, in pUSD


class StoreUnavailable(Exception):
    """The shared store did not answer (down, slow, or in its back-off window).

    ``maybe_applied``: the call was sent and may have run before the answer was lost.
    """

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


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
class BudgetGate:
    key: str  # the usage record of the budget's current window
    cap: int  # pUSD
    refuse: bool  # refuse at spend >= cap (on_exhausted: reject); else only report the spend


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
    # Sent again after an answer was lost, a settlement with an id runs at most once: the
    # store keeps ``done_key`` for an hour (one key per settled request: a day held 8.6 M keys
    # at 100 req/s). Without one (the memory store never loses answers) it simply runs.
    id: str = ""
    done_key: str = ""


class LimitStore(Protocol):
    """``kind`` is ``memory`` (one instance) or ``redis`` (shared by every instance)."""

    kind: Literal["memory", "redis"]

    async def acquire(self, req: AcquireRequest) -> AcquireResult:
        """All of ``req`` or none. A caller cancelled while waiting takes none either: what the
        store admitted all the same is given back (memory: an acquire never waits, so a caller
        cannot leave in the middle; Redis: when the lost reply comes)."""
        ...

    async def settle(self, req: SettleRequest) -> tuple[int, ...] | None:
        """The new SPEND of each usage record, in order; None if ``id`` had already run."""
        ...

    async def renew(
        self, leases: tuple[tuple[str, str], ...], ttl_ms: int, now_ms: int | None
    ) -> None:
        """Extend each (slot key, lease id) still held to ``ttl_ms`` from now."""
        ...

    async def read_usage(self, key: str, now_ms: int | None = None) -> dict[str, int]: ...

    def on_trouble(self, react: Callable[[], None]) -> None:
        """Call ``react`` as soon as the store may have become unavailable."""
        ...

    async def aclose(self) -> None: ...
