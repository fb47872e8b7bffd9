"""The in-process limit store: one gateway instance (``shared_state.redis_url`` empty).

The same contract and arithmetic as the Redis store (``gateway.limits.gcra``; leases that expire;
money fields in pUSD), run on the event loop without an await inside an operation, so each
``acquire`` and ``settle`` is atomic. State is bounded by the policy: one bucket and one slot
set per (tenant) and (tenant, surface) with a limit, and usage records per tenant and window,
dropped once their window is over (``keep_s``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from gateway.limits import gcra
from gateway.limits.store import (
    HELD,
    SPEND,
    AcquireRequest,
    AcquireResult,
    Blocker,
    BudgetGate,
    SettleRequest,
    held_amount,
    lease_ids,
)


class MemoryStore:
    kind: Literal["memory", "redis"] = "memory"

    def __init__(self) -> None:
        self._buckets: dict[str, gcra.Bucket] = {}
        # key -> lease id -> expiry (ms); a budget window's hold set too (member -> expiry)
        self._slots: dict[str, dict[str, int]] = {}
        self._usage: dict[str, tuple[int, dict[str, int]]] = {}  # key -> (expiry ms, fields)
        self._sweep_at = 0

    @staticmethod
    def _now(now_ms: int | None) -> int:
        return now_ms if now_ms is not None else int(time.time() * 1000)

    async def acquire(self, req: AcquireRequest) -> AcquireResult:
        now = self._now(req.now_ms)
        spend = held = 0
        over = False
        blocked: Blocker | None = None
        index = 0
        wait: int | None = 0
        gate = req.budget
        if gate is not None:
            spend = self._record(gate.key, now).get(SPEND, 0)
            held = self._held(gate.key, now)
            hold = gate.hold.amount if gate.hold is not None else 0
            over = spend >= gate.cap or (hold > 0 and spend + held + hold > gate.cap)
            if over and gate.refuse:
                blocked = "budget"
        debts: list[int] = []
        for i, take in enumerate(req.buckets):
            bucket = self._buckets.get(take.key) or gcra.Bucket(0, now)
            debt = gcra.debt_at(bucket, take.rate, now)
            debts.append(debt)
            need = gcra.wait_ms(debt, take.rate, take.amount)
            if need != 0 and blocked in (None, "bucket"):
                # Several buckets refuse: the request fits once the slowest one has drained.
                if blocked is None or need is None or (wait is not None and need > wait):
                    index, wait = i, need
                blocked = "bucket"
        leases_held: list[int] = []
        for j, slot in enumerate(req.slots):
            leases = self._live_leases(slot.key, now)
            leases_held.append(len(leases))
            if blocked is None and len(leases) + slot.count > slot.limit:
                blocked, index = "slot", j
        if blocked is not None:
            return AcquireResult(
                False, now, tuple(debts), tuple(leases_held), spend, blocked, index, wait, over,
                held,
            )  # fmt: skip
        for i, take in enumerate(req.buckets):
            bucket = self._buckets.setdefault(take.key, gcra.Bucket(0, now))
            gcra.take(bucket, take.rate, take.amount, now)
            debts[i] = bucket.debt
        for j, slot in enumerate(req.slots):
            leases = self._slots.setdefault(slot.key, {})
            for lease_id in lease_ids(req.lease_id, slot.count):
                leases[lease_id] = now + req.lease_ttl_ms
            leases_held[j] += slot.count
        if gate is not None and gate.hold is not None and not over:
            held += self._hold(gate, req.lease_ttl_ms, now)
        return AcquireResult(
            True, now, tuple(debts), tuple(leases_held), spend, over_budget=over, budget_held=held
        )

    async def settle(self, req: SettleRequest) -> tuple[int, ...]:
        now = self._now(req.now_ms)
        for adj in req.adjusts:
            bucket = self._buckets.setdefault(adj.key, gcra.Bucket(0, now))
            gcra.adjust(bucket, adj.rate, adj.delta, now)
        released = req.lease_id.split()
        for key in req.releases:
            leases = self._slots.get(key)
            if leases is not None:
                for lease_id in released:
                    leases.pop(lease_id, None)
        for hold in req.holds:
            members = self._slots.get(hold.key)
            if members is not None and members.pop(hold.member, None) is not None:
                if not members:
                    del self._slots[hold.key]
                record = self._record(hold.record, now)
                left = record.get(HELD, 0) - hold.amount
                if left > 0:
                    record[HELD] = left
                else:
                    record.pop(HELD, None)
        spends = []
        for add in req.usage:
            entry = self._usage.get(add.key)
            if entry is None or entry[0] <= now:
                entry = self._usage[add.key] = (now + add.keep_s * 1000, {})
            fields = entry[1]
            for name, value in add.fields:
                fields[name] = fields.get(name, 0) + value
            spends.append(fields.get(SPEND, 0))
        if now >= self._sweep_at:
            self._sweep_at = now + 60_000
            self._forget_old_records(now)
        return tuple(spends)

    async def renew(
        self, leases: tuple[tuple[str, str], ...], ttl_ms: int, now_ms: int | None
    ) -> None:
        now = self._now(now_ms)
        for key, lease_id in leases:
            held = self._slots.get(key)
            if held is not None and held.get(lease_id, 0) > now:
                held[lease_id] = now + ttl_ms

    async def read_usage(self, key: str, now_ms: int | None = None) -> dict[str, int]:
        """The record's fields; its ``HELD`` what the holds still live hold (those expired,
        their holder gone, are left out before the next check reclaims them)."""
        now = self._now(now_ms)
        fields = dict(self._record(key, now))
        members = self._slots.get(key + ":h", {})
        held = sum(held_amount(m) for m, expiry in members.items() if expiry > now)
        fields.pop(HELD, None)
        if held > 0:
            fields[HELD] = held
        return fields

    def on_trouble(self, react: Callable[[], None]) -> None:
        """Memory never fails: nothing to tell."""

    async def aclose(self) -> None:
        return None

    def _live_leases(self, key: str, now: int) -> dict[str, int]:
        leases = self._slots.setdefault(key, {})
        for lease_id in [k for k, expiry in leases.items() if expiry <= now]:
            del leases[lease_id]
        return leases

    def _held(self, key: str, now: int) -> int:
        """What the holds of a budget's window hold, those expired reclaimed (``lua.ACQUIRE``)."""
        record = self._record(key, now)
        held = record.get(HELD, 0)
        if held <= 0:
            return 0
        members = self._slots.get(key + ":h", {})
        gone = [m for m, expiry in members.items() if expiry <= now]
        for member in gone:
            held -= held_amount(member)
            del members[member]
        if not members or held <= 0:
            record.pop(HELD, None)
            self._slots.pop(key + ":h", None)
            return 0
        if gone:
            record[HELD] = held
        return held

    def _hold(self, gate: BudgetGate, ttl_ms: int, now: int) -> int:
        assert gate.hold is not None
        self._slots.setdefault(gate.hold.key, {})[gate.hold.member] = now + ttl_ms
        entry = self._usage.get(gate.key)
        if entry is None or entry[0] <= now:
            entry = self._usage[gate.key] = (now + gate.keep_s * 1000, {})
        entry[1][HELD] = entry[1].get(HELD, 0) + gate.hold.amount
        return gate.hold.amount

    def _record(self, key: str, now: int) -> dict[str, int]:
        entry = self._usage.get(key)
        if entry is None or entry[0] <= now:
            return {}
        return entry[1]

    def _forget_old_records(self, now: int) -> None:
        for key in [k for k, (expiry, _) in self._usage.items() if expiry <= now]:
            del self._usage[key]
