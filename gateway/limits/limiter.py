"""The limiter: admits a request against its tenant's rules, then settles what it used.

``admit`` makes one store call for everything that binds the request (budget, requests and
tokens per minute, concurrency; the tenant's own and on its surface): all are taken, or none
and ``LimitExceeded`` says which and when to retry. Tokens are reserved from an estimate, and
under a budget the request's worst-case cost is held (``gateway.limits.store.Hold``: admitted
only while the budget covers what is spent, what requests in flight hold and this one);
``finish`` (in the background, off the request's time) reconciles the tokens with the real
usage (or gives them all back when the request failed), releases the concurrency lease and
the hold and adds the usage and cost to the tenant's day, week and month records, firing
budget alerts, in one store call.

With ``grant_requests`` (the Redis store: ``shared_state.grant_requests``), a check made while
every limit is far from reached also takes a grant for the instance's next few requests of
that subject, admitted in memory (``gateway.limits.grants``: why that stays exact). A subject
with a budget takes none: each of its requests holds its own cost in the store.

Concurrency leases and budget holds expire after ``lease_ttl_s`` unless renewed: this
instance renews those it holds every third of that, so a crashed instance's slots and holds
come back within the TTL.

The store unavailable (Redis down): ``fail_open`` admits without limits (the budget is not
checked either), otherwise requests are refused (``reason="unavailable"``). Either way each
such decision is counted (``counts.unavailable``, by the direction it took) and one warning is
logged per outage; usage that could not be written is kept and written once the store answers
(``gateway.limits.ledger``). A check the store failed alone (``ScriptError``) is answered the
same way, that request only: the store is not down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.limits import grants
from gateway.limits.check import LimitExceeded, rate_view, refusal, takes
from gateway.limits.grants import Grant
from gateway.limits.headers import RateView, rate_headers, retry_headers
from gateway.limits.ledger import Ledger
from gateway.limits.rules import Keys, Subject
from gateway.limits.store import (
    AcquireRequest,
    BucketAdjust,
    BucketTake,
    BudgetGate,
    Hold,
    LimitCounts,
    LimitStore,
    ScriptError,
    SlotTake,
    StoreUnavailable,
    lease_ids,
)
from gateway.limits.usage import BudgetAlert, UsageRecord
from gateway.limits.windows import Window, window_of

log = logging.getLogger("llm_gateway.limits")

FLUSH_S = 0.25  # how late the usage of an unlimited request may be written


@dataclass(slots=True)
class Admission:
    subject: Subject
    requests: RateView | None = None
    tokens: RateView | None = None
    reserved: tuple[BucketTake, ...] = ()  # token buckets, to reconcile
    slots: tuple[str, ...] = ()
    lease_id: str = ""
    spend: int = 0  # pUSD in the budget's window when admitted
    hold: Hold | None = None  # the worst-case cost held against the budget until it settles
    downgrade: bool = False  # the budget cannot cover it and on_exhausted: downgrade
    degraded: bool = False  # admitted without limits: the store was unavailable
    settled: bool = field(default=False)

    def headers(self) -> dict[str, str]:
        return rate_headers(self.requests, self.tokens)


class Limiter:
    def __init__(
        self,
        store: LimitStore,
        *,
        fail_open: bool = True,
        keys: Keys | None = None,
        clock: Callable[[], float] | None = None,  # Unix seconds; None: the store's clock
        lease_ttl_s: float = 30.0,
        on_alert: Callable[[BudgetAlert], None] | None = None,
        grant_requests: int = 0,  # 0: every request asks the store
        grant_ttl_s: float = 0.25,
        counts: LimitCounts | None = None,  # a replaced limiter's, to count on from
    ) -> None:
        self.store = store
        self.counts = LimitCounts() if counts is None else counts
        self._grants: dict[Subject, Grant] = {}
        self._grant_next: dict[Subject, int] = {}  # the grant the next check may take
        # A check taking a grant is in flight: the subject's other requests wait for it.
        self._granting: dict[Subject, asyncio.Event] = {}
        self.keys = keys or Keys()
        self._clock = clock
        # a request's lease id -> what it renews: (slot set, lease id), (hold set, member)
        self._leases: dict[str, tuple[tuple[str, str], ...]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._retimed = asyncio.Event()  # the lease TTL changed: renew now, at the new pace
        self.fail_open = fail_open
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.grant_requests = grant_requests
        self.grant_ttl_s = _grant_ttl(grant_ttl_s, lease_ttl_s)
        self._flusher: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._lease_prefix = os.urandom(6).hex()
        self._outage = False
        self.ledger = Ledger(
            store, self.keys, self.now_s, self._now_ms, self._lease_prefix + "-s", on_alert,
            self.counts.alerts, self.counts.records_lost,
        )  # fmt: skip
        self.ledger.on_success = self._recovered
        # Redis may be gone: what grants hold is not admitted any more (a request then asks the
        # store, so an outage is met in the configured direction at once); given back if it can.
        store.on_trouble(self._store_trouble)

    def configure(
        self, *, fail_open: bool, lease_ttl_s: float, grant_requests: int, grant_ttl_s: float
    ) -> None:
        """Apply settings a reload may change. The limiter itself stays (``gateway.build``):
        its store (in memory: the counters), the leases it renews, the settlements in flight
        and the usage waiting to be written all belong to requests that are still running."""
        lease_ttl_ms = int(lease_ttl_s * 1000)
        grant_ttl_s = _grant_ttl(grant_ttl_s, lease_ttl_s)
        if (grant_requests, grant_ttl_s) != (self.grant_requests, self.grant_ttl_s):
            self._give_all_back()  # taken and sized under the old settings
            self._grant_next.clear()
        if lease_ttl_ms != self.lease_ttl_ms:
            self._retimed.set()
        self.fail_open = fail_open
        self.lease_ttl_ms = lease_ttl_ms
        self.grant_requests = grant_requests
        self.grant_ttl_s = grant_ttl_s

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_loop(), name="limits-lease-renewal")

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        await self.drain()
        await self.store.aclose()

    async def drain(self) -> None:
        """Give the grants back, wait for the settlements in flight and write the deferred
        records (tests, shutdown)."""
        self._give_all_back()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        with contextlib.suppress(StoreUnavailable):
            await self.ledger.flush()

    def now_s(self) -> float:
        return self._clock() if self._clock is not None else time.time()

    def _now_ms(self) -> int | None:
        return None if self._clock is None else int(self._clock() * 1000)

    # ---- admission -----------------------------------------------------------------------

    async def admit(self, subject: Subject, tokens: int, cost: int = 0) -> Admission:
        """Take every limit of ``subject`` for one request reserving ``tokens`` and, under a
        budget, holding ``cost`` (pUSD: the most its answer may cost), or raise."""
        if not subject.limited and subject.budget is None:
            return Admission(subject)
        if subject.budget is not None:
            return await self._check(subject, tokens, 0, cost)  # no grant: module comment
        grant = self._grants.get(subject)
        if grant is not None and grant.fits(tokens, time.monotonic()):
            return self._from_grant(subject, grant, tokens)
        coming = self._granting.get(subject)
        if coming is not None:
            # A grant is on its way: wait for it rather than race it to Redis (a burst would
            # otherwise take the limit with checks of its own and leave the grant unused).
            await coming.wait()
            grant = self._grants.get(subject)
            if grant is not None and grant.fits(tokens, time.monotonic()):
                return self._from_grant(subject, grant, tokens)
            return await self._check(subject, tokens, 0)
        more = self._grant_next.get(subject, 0)
        if more:
            coming = self._granting[subject] = asyncio.Event()
            try:
                return await self._check(subject, tokens, more)
            except LimitExceeded as exc:
                if exc.reason == "unavailable":
                    raise
                # Refused with its grant: the request alone may still fit.
                self._grant_next[subject] = 0
            finally:
                del self._granting[subject]
                coming.set()
        return await self._check(subject, tokens, 0)

    def _gate(self, subject: Subject, hold_id: str, cost: int) -> BudgetGate | None:
        budget = subject.budget
        if budget is None:
            return None
        now = self.now_s()
        window = window_of(budget.window, now)
        key = self.keys.record(subject.tenant, window)
        refuse = budget.on_exhausted == "reject"
        if cost <= 0:
            return BudgetGate(key, budget.cap, refuse)
        return BudgetGate(key, budget.cap, refuse, Hold.of(key, hold_id, cost), window.keep_s(now))

    async def _check(self, subject: Subject, tokens: int, more: int, cost: int = 0) -> Admission:
        """One store call: this request's limits (its cost held under a budget), and ``more``
        requests' for a grant."""
        buckets, slots, kinds = takes(self.keys, subject, tokens)
        holding = cost > 0 and subject.budget is not None
        lease_id = f"{self._lease_prefix}-{next(self._ids)}" if slots or holding else ""
        gate = self._gate(subject, lease_id, cost)
        asked_b, asked_s = buckets, slots
        if more:
            asked_b = [BucketTake(b.key, b.rate, b.amount * (1 + more)) for b in buckets]
            asked_s = [SlotTake(s.key, s.limit, 1 + more) for s in slots]
        req = AcquireRequest(
            tuple(asked_b), tuple(asked_s), gate, lease_id, self.lease_ttl_ms, self._now_ms()
        )
        try:
            result = await self.store.acquire(req)
        except ScriptError:  # this check alone failed (logged by the store): not an outage
            return self._unavailable(subject, outage=False)
        except StoreUnavailable:
            return self._unavailable(subject)
        self._recovered()
        if not result.admitted:
            requests = rate_view(req, result, kinds, "requests")
            tokens_view = rate_view(req, result, kinds, "tokens")
            raise refusal(subject, req, result, kinds, requests, tokens_view, self.now_s)
        if self.grant_requests and gate is None:
            if len(self._grant_next) > 4096:  # subjects of policies reloaded away
                self._grant_next.clear()
            # Sized on what this check found, its own grant taken: 0 when any limit is now too
            # close for one, and then a grant just taken goes back at once.
            self._grant_next[subject] = grants.size(
                self.grant_requests, req, result, tuple(k for k, _ in kinds), tokens
            )
        own = lease_id
        views = (rate_view(req, result, kinds, "requests"), rate_view(req, result, kinds, "tokens"))
        if more:
            now = time.monotonic()
            seen = self.now_s()
            leases = lease_ids(lease_id, 1 + more)
            own = leases[0]
            grant = Grant(
                buckets=tuple(buckets),
                kinds=tuple(k for k, _ in kinds),
                left=[b.amount * more for b in buckets],
                leases=leases[1:],
                slots=tuple(s.key for s in slots),
                requests=more,
                debts=result.debts,
                found_at=seen,
                expires=now + self.grant_ttl_s,
            )
            self._take_grant(subject, grant)
            views = (grant.view("requests", seen), grant.view("tokens", seen))
            if not self._grant_next[subject]:
                self._give_back(subject, grant)
        hold = gate.hold if gate is not None and not result.over_budget else None
        renewed = tuple((s.key, own) for s in slots)
        if hold is not None:
            renewed += ((hold.key, hold.member),)
        if renewed:
            self._leases[own] = renewed
        return Admission(
            subject,
            views[0],
            views[1],
            reserved=tuple(b for b, k in zip(buckets, kinds, strict=True) if k[0] == "tokens"),
            slots=tuple(s.key for s in slots),
            lease_id=own,
            spend=result.spend,
            hold=hold,
            downgrade=result.over_budget,  # admitted over the budget: on_exhausted downgrade
        )

    # ---- grants (gateway.limits.grants) -----------------------------------------------------

    def _take_grant(self, subject: Subject, grant: Grant) -> None:
        old = self._grants.get(subject)
        if old is not None:
            self._give_back(subject, old)
        self._grants[subject] = grant
        loop = asyncio.get_running_loop()
        grant.timer = loop.call_later(self.grant_ttl_s, self._give_back, subject, grant)

    def _from_grant(self, subject: Subject, grant: Grant, tokens: int) -> Admission:
        reserved, lease = grant.draw(tokens)
        self.counts.granted += 1
        if lease:
            self._leases[lease] = tuple((key, lease) for key in grant.slots)
        seen = self.now_s()
        admission = Admission(
            subject,
            grant.view("requests", seen),
            grant.view("tokens", seen),
            reserved=reserved,
            slots=grant.slots if lease else (),
            lease_id=lease,
        )
        if grant.requests == 0:
            self._give_back(subject, grant)  # its unused tokens
        return admission

    def _give_all_back(self) -> None:
        for subject, grant in list(self._grants.items()):
            self._give_back(subject, grant)

    def _store_trouble(self) -> None:
        """Redis may be gone: no request is admitted from a grant until a check succeeds."""
        self._give_all_back()
        self._grant_next.clear()

    def _give_back(self, subject: Subject, grant: Grant) -> None:
        """Return what ``grant`` still holds: its requests and tokens to the buckets, its
        unused leases released (one settlement, in the background)."""
        if grant.returned:
            return
        grant.returned = True
        if grant.timer is not None:
            grant.timer.cancel()
        if self._grants.get(subject) is grant:
            del self._grants[subject]
        adjusts = tuple(
            BucketAdjust(b.key, b.rate, -left)
            for b, left in zip(grant.buckets, grant.left, strict=True)
            if left > 0
        )
        unused = " ".join(grant.leases)
        if not adjusts and not unused:
            return
        release = grant.slots if unused else ()
        self._background(self.ledger.settle(subject, adjusts, release, unused, None))

    @property
    def granted(self) -> int:
        """Requests admitted from a grant."""
        return self.counts.granted

    @property
    def unavailable(self) -> int:
        """Decisions taken while the store was unavailable, either way."""
        return sum(self.counts.unavailable.values())

    def _unavailable(self, subject: Subject, *, outage: bool = True) -> Admission:
        # Labelled with the direction taken now: a reload may change limits_failure_mode.
        unavailable, direction = self.counts.unavailable, "open" if self.fail_open else "closed"
        unavailable[direction] = unavailable.get(direction, 0) + 1
        if outage and not self._outage:
            self._outage = True
            direction = "admitting without limits" if self.fail_open else "refusing requests"
            log.warning("limit store unavailable: %s until it answers", direction)
        if self.fail_open:
            return Admission(subject, degraded=True)
        raise LimitExceeded(
            "unavailable",
            "the rate limiter is unavailable; retry shortly",
            retry_headers(1000),
        )

    def _recovered(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("limit store available again; limits enforced")

    # ---- settlement ----------------------------------------------------------------------

    def finish(self, admission: Admission, record: UsageRecord | None) -> None:
        """Settle in the background: ``record`` None means the request failed (no usage).

        A request that holds nothing (no limit, no budget: only its usage to account for) is
        not written on its own: its record is merged in memory and written with the others of
        its tenant at the next flush (``FLUSH_S``), one store call for many requests.
        """
        if admission.settled:
            return
        admission.settled = True
        subject = admission.subject
        if not subject.limited and subject.budget is None:
            if record is not None:
                self.ledger.defer(subject, record)
                self._flush_soon()
            return
        if admission.lease_id:
            self._leases.pop(admission.lease_id, None)
        self._background(self.settle(admission, record))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, admission: Admission, record: UsageRecord | None) -> None:
        used = record.usage.total if record is not None else 0
        adjusts = tuple(
            BucketAdjust(b.key, b.rate, used - b.amount)
            for b in admission.reserved
            if used != b.amount
        )
        holds = (admission.hold,) if admission.hold is not None else ()
        await self.ledger.settle(
            admission.subject, adjusts, admission.slots, admission.lease_id, record, holds
        )

    async def flush(self) -> None:
        await self.ledger.flush()

    def _flush_soon(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(FLUSH_S)
        with contextlib.suppress(StoreUnavailable):
            await self.ledger.flush()

    async def _renew_loop(self) -> None:
        while True:
            # A third of the TTL, read afresh: a reload that shortens it must not leave the
            # leases taken since waiting out the old pace.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._retimed.wait(), self.lease_ttl_ms / 3000)
            self._retimed.clear()
            leases = tuple(pair for pairs in list(self._leases.values()) for pair in pairs)
            with contextlib.suppress(StoreUnavailable):
                await self.store.renew(leases, self.lease_ttl_ms, self._now_ms())
                await self.ledger.flush()

    # ---- reports -------------------------------------------------------------------------

    async def record_of(self, tenant: str, window: Window) -> dict[str, int]:
        return await self.store.read_usage(self.keys.record(tenant, window), self._now_ms())


def _grant_ttl(grant_ttl_s: float, lease_ttl_s: float) -> float:
    """A grant's unused leases are not renewed: it ends well before they could expire."""
    return min(grant_ttl_s, lease_ttl_s / 3)
