"""Grants: a few requests' worth of a tenant's limits, taken from the shared store ahead of time.

Asking Redis on every request puts a round trip (~0.2 ms on loopback, more across a network)
in every limited request's path. When the last answer for a subject (a tenant on a surface)
showed its limits far from reached, the next check also takes a grant: ``n`` more requests,
``n`` times this request's token estimate, ``n`` more concurrency leases, in the same atomic
script as the request itself. The instance's next requests of that subject are then admitted
from the grant, in memory, until it is used up or ``ttl_s`` has passed; what is left is given
back (the tokens and requests returned to the buckets, the unused leases released).

Why the limits stay exact:

* everything a grant admits was taken in Redis first, by one atomic script: N instances never
  admit more than a limit, whatever their grants (they can only admit less, and only while
  another instance holds unused grant units: at most ``n`` per instance, for at most
  ``ttl_s``);
* a grant is taken only while every limit has at least ``HEADROOM`` times the grant left
  (requests, tokens, leases), so near a limit every request asks Redis itself: a burst at a
  tenant's limit admits exactly the limit, as without grants;
* a request's token reservation is reconciled with its real usage as any other (its settlement
  is the same), and its lease is its own, released when it ends;
* a budget is checked against the spend Redis reported when the grant was taken (at most
  ``ttl_s`` old), and no grant is taken once the spend reaches ``BUDGET_SHARE`` of the cap;
  from there every request reads the spend afresh.

The ``x-ratelimit-remaining-*`` headers of a request admitted from a grant are those of the
grant's check plus what the grant still holds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from gateway.limits import gcra
from gateway.limits.headers import RateView
from gateway.limits.store import AcquireRequest, AcquireResult, BucketTake

HEADROOM = 64  # a grant of n needs HEADROOM x n left in every limit it takes from
BUDGET_SHARE = 0.8  # no grant once the budget's spend reaches this share of its cap
MIN_GRANT = 2  # smaller grants are not worth their return write

Kind = Literal["requests", "tokens"]


@dataclass(slots=True)
class Grant:
    """The units one instance holds for a subject's next requests (``Limiter`` owns them)."""

    buckets: tuple[BucketTake, ...]  # the subject's buckets (their amounts: the asking request's)
    kinds: tuple[Kind, ...]  # per bucket
    left: list[int]  # units still held, per bucket
    tokens: int  # the token estimate per request the grant was sized for
    leases: list[str]  # unused lease ids, one per request left (when the subject has slots)
    slots: tuple[str, ...]  # the slot sets the leases are in
    requests: int  # requests left
    budget_key: str | None  # the budget window's record the spend was read from
    spend: int  # pUSD, as Redis reported it when the grant was taken
    views: tuple[RateView | None, RateView | None]  # requests, tokens: as found by the check
    expires: float  # time.monotonic()
    returned: bool = False
    timer: asyncio.TimerHandle | None = None  # gives it back at ``expires``

    def fits(self, tokens: int, budget_key: str | None, now: float) -> bool:
        if self.returned or self.requests <= 0 or now >= self.expires:
            return False
        if budget_key != self.budget_key:
            return False  # the budget's window turned since
        return all(
            k == "requests" or left >= tokens for k, left in zip(self.kinds, self.left, strict=True)
        )

    def draw(self, tokens: int) -> tuple[tuple[BucketTake, ...], str]:
        """One request's share: its token reservations (to reconcile) and its lease id."""
        self.requests -= 1
        reserved: list[BucketTake] = []
        for i, (take, kind) in enumerate(zip(self.buckets, self.kinds, strict=True)):
            if kind == "requests":
                self.left[i] -= 1
            else:
                self.left[i] -= tokens
                reserved.append(BucketTake(take.key, take.rate, tokens))
        lease = self.leases.pop() if self.leases else ""
        return tuple(reserved), lease

    def view(self, kind: Kind) -> RateView | None:
        """What the tenant may still take, as this instance knows it: the check's remaining
        plus what the grant holds."""
        found = self.views[0 if kind == "requests" else 1]
        if found is None:
            return None
        held = min(
            (left for k, left in zip(self.kinds, self.left, strict=True) if k == kind), default=0
        )
        return RateView(found.limit, found.remaining + held, found.reset_ms)


def size(
    most: int,
    req: AcquireRequest,
    result: AcquireResult,
    kinds: tuple[Kind, ...],
    tokens: int,
    budget_cap: int | None,
) -> int:
    """The grant the next check of this subject may take, from what this check found: 0 when
    any limit is within ``HEADROOM`` grants of being reached (or the budget nearly spent)."""
    if most < MIN_GRANT:
        return 0
    if budget_cap is not None and result.spend >= budget_cap * BUDGET_SHARE:
        return 0
    room = most
    for take, debt, kind in zip(req.buckets, result.debts, kinds, strict=True):
        unit = 1 if kind == "requests" else max(tokens, 1)
        room = min(room, gcra.remaining(debt, take.rate) // (HEADROOM * unit))
    for slot, held in zip(req.slots, result.held, strict=True):
        room = min(room, (slot.limit - held) // HEADROOM)
    return room if room >= MIN_GRANT else 0
