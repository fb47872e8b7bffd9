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
* a subject with a budget takes no grant: each of its requests holds its own worst-case cost
  in the store until it settles (``gateway.limits.store.Hold``), which units taken for
  requests not yet known could not do, so it asks the store on every request.

While a check taking a grant is in flight, the subject's other requests on this instance wait
for it and draw from it (then check themselves if it cannot serve them): a burst does not race
its own grant to Redis, which would leave the grant unused while the burst is refused
elsewhere. The first sign that Redis may be gone (a connection it closed, a failed call) gives
every grant back (or drops it, if Redis cannot be told): requests then ask Redis and meet an
outage in the configured direction (``limits_failure_mode``) at once.

The ``x-ratelimit-*`` headers of a request admitted from a grant are computed from the grant's
check: its debt without what the grant still holds, drained for the time since. For one
instance that is what a check per request would have reported; with several, each instance
sees the others' use as of its last check.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from gateway.limits import gcra
from gateway.limits.headers import RateView
from gateway.limits.store import AcquireRequest, AcquireResult, BucketTake

HEADROOM = 64  # a grant of n needs HEADROOM x n left in every limit it takes from
MIN_GRANT = 2  # smaller grants are not worth their return write

Kind = Literal["requests", "tokens"]


@dataclass(slots=True)
class Grant:
    """The units one instance holds for a subject's next requests (``Limiter`` owns them)."""

    buckets: tuple[BucketTake, ...]  # the subject's buckets (their amounts: the asking request's)
    kinds: tuple[Kind, ...]  # per bucket
    left: list[int]  # units still held, per bucket
    leases: list[str]  # unused lease ids, one per request left (when the subject has slots)
    slots: tuple[str, ...]  # the slot sets the leases are in
    requests: int  # requests left
    debts: tuple[int, ...]  # per bucket, as the check left them (the grant's units included)
    found_at: float  # the limiter's clock (Unix seconds) at the check
    expires: float  # time.monotonic()
    returned: bool = False
    timer: asyncio.TimerHandle | None = None  # gives it back at ``expires``

    def fits(self, tokens: int, now: float) -> bool:
        if self.returned or self.requests <= 0 or now >= self.expires:
            return False
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

    def view(self, kind: Kind, now: float) -> RateView | None:
        """The ``x-ratelimit-*`` view of ``kind`` as this instance knows it: the check's
        debt without what the grant still holds, drained for the time since (the tighter of
        the tenant's and the surface's bucket, as ``Limiter`` reports them). For one instance
        this is what a check per request would have reported."""
        elapsed_ms = max(0, int((now - self.found_at) * 1000))
        best: RateView | None = None
        for take, k, debt, left in zip(
            self.buckets, self.kinds, self.debts, self.left, strict=True
        ):
            if k != kind:
                continue
            rate = take.rate
            used = max(0, debt - left * rate.period_ms - elapsed_ms * rate.limit)
            view = RateView(rate.limit, gcra.remaining(used, rate), gcra.reset_ms(used, rate))
            if best is None or (view.remaining, view.limit) < (best.remaining, best.limit):
                best = view
        return best


def size(
    most: int,
    req: AcquireRequest,
    result: AcquireResult,
    kinds: tuple[Kind, ...],
    tokens: int,
) -> int:
    """The grant the next check of this subject may take, from what this check found: 0 when
    any limit is within ``HEADROOM`` grants of being reached."""
    if most < MIN_GRANT:
        return 0
    room = most
    for take, debt, kind in zip(req.buckets, result.debts, kinds, strict=True):
        unit = 1 if kind == "requests" else max(tokens, 1)
        room = min(room, gcra.remaining(debt, take.rate) // (HEADROOM * unit))
    for slot, held in zip(req.slots, result.held, strict=True):
        room = min(room, (slot.limit - held) // HEADROOM)
    return room if room >= MIN_GRANT else 0
