"""Settlements: what a finished request writes, written once even when the store falters.

One settlement per request: its token reconciliation, its lease and budget hold releases and
its usage in the tenant's day, week and month records, as one store call carrying an id (the
store runs an id at most once; a hold is released at most once whatever runs, as its member
leaves the hold set once). Budget alerts are decided on the store's answer
(``gateway.limits.usage``).

When the store is unavailable, nothing a tenant spent is lost and nothing is counted twice:

* a call that certainly did not run (refused connection, back-off) leaves its usage merged
  into ``pending``, one entry per tenant record (so bounded by tenants x windows);
* a call that may have run (its answer was lost) is kept whole, id included, in ``uncertain``
  (at most ``MAX_UNCERTAIN``; past that its usage is merged into ``pending`` and counted in
  ``uncertain_merged``, since it may then be counted twice);

and both are written by the next successful settlement, or by ``flush`` (the limiter calls it
every few seconds). A settlement the store failed alone (``ScriptError``: a bug, or an amount
it cannot take) is not sent again and its records are counted in ``lost`` (on ``/metrics`` as
``llm_gateway_limits_records_lost_total{reason="script_error"}``; records past
``MAX_PENDING_RECORDS`` as ``pending_full``): sent again it would fail again, and hold up every
write queued behind it. Redis does not roll a failed script back, so such a settlement may be
partly written (its first windows charged, the rest not). Token adjustments, lease and hold
releases are not kept: the buckets drain and the leases and holds expire on their own (their
holder stops renewing them), a hold erring on the safe side meanwhile (it holds more of the
budget than is spent).

A request that holds nothing (its tenant has no limit and no budget) only adds usage: ``defer``
merges it into ``pending`` the same way, and the limiter flushes within a quarter second, so
the common case costs a dictionary update per request instead of a store call.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.limits.rules import Keys, Subject
from gateway.limits.store import (
    SPEND,
    BucketAdjust,
    Hold,
    LimitStore,
    ScriptError,
    SettleRequest,
    StoreUnavailable,
    UsageAdd,
)
from gateway.limits.usage import BudgetAlert, UsageRecord, crossed
from gateway.limits.windows import WINDOW_KINDS, Window, window_of

log = logging.getLogger("llm_gateway.limits")

MAX_PENDING_RECORDS = 10_000
MAX_UNCERTAIN = 1_000


@dataclass(slots=True)
class _Entry:
    """One usage addition and what its alerts need to know."""

    add: UsageAdd
    subject: Subject
    window: Window


@dataclass(slots=True)
class _Pending:
    """Usage waiting to be written: one tenant's record of one window, merged in place."""

    key: str
    subject: Subject
    window: Window
    fields: dict[str, int]

    def entry(self, now_s: float) -> _Entry:
        add = UsageAdd(self.key, self.window.keep_s(now_s), tuple(self.fields.items()))
        return _Entry(add, self.subject, self.window)


class Ledger:
    def __init__(
        self,
        store: LimitStore,
        keys: Keys,
        now_s: Callable[[], float],
        now_ms: Callable[[], int | None],
        id_prefix: str,
        on_alert: Callable[[BudgetAlert], None] | None = None,
        alert_counts: dict[tuple[str, str, str], int] | None = None,  # kept across limiters
        lost: dict[str, int] | None = None,  # reason -> records never written; kept too
    ) -> None:
        self.store = store
        self.keys = keys
        self._now_s = now_s
        self._now_ms = now_ms
        self._id_prefix = id_prefix
        self._ids = itertools.count()
        self.on_alert = on_alert
        self._pending: dict[str, dict[str, _Pending]] = {}  # tenant -> record key -> usage
        # tenant -> (UTC day, its day, week and month records): asked on every request
        self._windows: dict[str, tuple[int, tuple[tuple[Window, str], ...]]] = {}
        self._pending_count = 0
        self._uncertain: list[tuple[SettleRequest, list[_Entry]]] = []
        self._flushing = False
        self.lost = {} if lost is None else lost
        self.uncertain_merged = 0
        self.alerts_fired = 0
        # (tenant, window, fraction) -> alerts fired
        self.alert_counts = {} if alert_counts is None else alert_counts
        self.on_success: Callable[[], None] = lambda: None

    @property
    def waiting(self) -> bool:
        return bool(self._pending or self._uncertain)

    @property
    def uncertain(self) -> int:
        """Settlements kept whole because their answer was lost (they may have run)."""
        return len(self._uncertain)

    async def settle(
        self,
        subject: Subject,
        adjusts: tuple[BucketAdjust, ...],
        slots: tuple[str, ...],
        lease_id: str,
        record: UsageRecord | None,
        holds: tuple[Hold, ...] = (),
    ) -> None:
        entries: list[_Entry] = []
        if record is not None:
            now = self._now_s()
            fields = record.fields()
            for window, key in self._records(subject.tenant, now):
                entries.append(_Entry(UsageAdd(key, window.keep_s(now), fields), subject, window))
        if adjusts or slots or entries or holds:
            req = self._request(subject.tenant, adjusts, slots, lease_id, entries, holds)
            if not await self._send(req, entries):
                return
        if self.waiting:
            await self.flush()

    def defer(self, subject: Subject, record: UsageRecord) -> None:
        """Merge a request's usage into its tenant's pending records (written by ``flush``)."""
        fields = record.fields()
        for window, key in self._records(subject.tenant, self._now_s()):
            self._merge(subject, window, key, fields)

    def _records(self, tenant: str, now_s: float) -> tuple[tuple[Window, str], ...]:
        """The tenant's day, week and month records at ``now_s``, with their keys."""
        day = int(now_s // 86_400)
        known = self._windows.get(tenant)
        if known is None or known[0] != day:
            if len(self._windows) > 4096:  # tenants of policies reloaded away
                self._windows.clear()
            windows = [window_of(kind, now_s) for kind in WINDOW_KINDS]
            known = self._windows[tenant] = (
                day,
                tuple((w, self.keys.record(tenant, w)) for w in windows),
            )
        return known[1]

    async def flush(self) -> None:
        """Write what earlier settlements could not; stop at the first failure."""
        if self._flushing:
            return  # another task is at it: one writer keeps the order and the ids
        self._flushing = True
        try:
            await self._flush()
        finally:
            self._flushing = False

    async def _flush(self) -> None:
        while self._uncertain:
            req, entries = self._uncertain[0]
            try:
                spends = await self.store.settle(req)
            except ScriptError:
                self._uncertain.pop(0)
                self._lose("script_error", len(entries))
                continue
            except StoreUnavailable:
                return
            self._uncertain.pop(0)
            self._answered(entries, spends)
        for tenant in list(self._pending):
            now = self._now_s()
            entries = [p.entry(now) for p in self._pending.pop(tenant).values()]
            self._pending_count -= len(entries)
            if not await self._send(self._request(tenant, (), (), "", entries), entries):
                return

    def _request(
        self,
        tenant: str,
        adjusts: tuple[BucketAdjust, ...],
        slots: tuple[str, ...],
        lease_id: str,
        entries: list[_Entry],
        holds: tuple[Hold, ...] = (),
    ) -> SettleRequest:
        sid = f"{self._id_prefix}-{next(self._ids)}"
        return SettleRequest(
            adjusts,
            slots,
            lease_id,
            tuple(e.add for e in entries),
            self._now_ms(),
            holds=holds,
            id=sid,
            done_key=f"{self.keys.scope(tenant)}:done:{sid}",
        )

    async def _send(self, req: SettleRequest, entries: list[_Entry]) -> bool:
        try:
            spends = await self.store.settle(req)
        except ScriptError:  # logged by the store; sent again, it would fail again
            self._lose("script_error", len(entries))
            return True
        except StoreUnavailable as exc:
            if exc.maybe_applied and len(self._uncertain) < MAX_UNCERTAIN:
                self._uncertain.append((req, entries))
            else:
                self.uncertain_merged += exc.maybe_applied
                for entry in entries:
                    self._keep(entry)
            return False
        self._answered(entries, spends)
        return True

    def _lose(self, reason: str, records: int) -> None:
        self.lost[reason] = self.lost.get(reason, 0) + records

    def _answered(self, entries: list[_Entry], spends: tuple[int, ...] | None) -> None:
        self.on_success()
        if spends is None:
            return  # ran before, its answer lost: its alerts were decided then
        for entry, after in zip(entries, spends, strict=True):
            self._alerts(entry, after)

    def _keep(self, entry: _Entry) -> None:
        self._merge(entry.subject, entry.window, entry.add.key, entry.add.fields)

    def _merge(
        self, subject: Subject, window: Window, key: str, fields: tuple[tuple[str, int], ...]
    ) -> None:
        records = self._pending.get(subject.tenant)
        if records is None:
            records = self._pending[subject.tenant] = {}
        pending = records.get(key)
        if pending is None:
            if self._pending_count >= MAX_PENDING_RECORDS:
                self._lose("pending_full", 1)
                return
            records[key] = _Pending(key, subject, window, dict(fields))
            self._pending_count += 1
            return
        merged = pending.fields
        for name, value in fields:
            merged[name] = merged.get(name, 0) + value

    def _alerts(self, entry: _Entry, after: int) -> None:
        budget = entry.subject.budget
        if budget is None or budget.window != entry.window.kind:
            return
        before = after - dict(entry.add.fields).get(SPEND, 0)
        for fraction in crossed(budget, before, after):
            alert = BudgetAlert(entry.subject.tenant, entry.window, fraction, after, budget.cap)
            self.alerts_fired += 1
            key = (alert.tenant, entry.window.kind, str(fraction))
            self.alert_counts[key] = self.alert_counts.get(key, 0) + 1
            log.warning(
                "budget alert: tenant %s has spent %s of its %s budget (%s)",
                alert.tenant,
                f"{fraction:.0%}",
                entry.window.kind,
                entry.window.id,
            )
            if self.on_alert is not None:
                self.on_alert(alert)
