"""The Redis limit store: every gateway instance shares one set of counters.

Each ``acquire`` and ``settle`` is one Lua script (``gateway.limits.lua``) run atomically by
Redis, so N instances admit exactly what one would: there is no read-then-write window
between them. Calls travel pipelined (``gateway.limits.redis_pipe``). All of a tenant's keys
share the hash tag ``{<tenant>}``, and every call touches one tenant's keys only, so a Redis
Cluster keeps each call in one slot.

Redis down or slow: each batch of calls is bounded by ``timeout_s`` from its write; the first
failure logs one warning and opens a back-off window of ``retry_after_s`` in which calls fail
at once with ``StoreUnavailable`` (no connection storm, no added latency while Redis is
away); the first success after it logs the recovery. ``failures`` counts failed calls.
A script that fails (``ScriptError``: a bug of ours, or an input it cannot take) fails its
own call only: Redis answered, so there is no back-off for the others; each kind of error is
logged once, and ``script_errors`` counts them all.

A check whose answer was lost (it timed out, its connection closed, or its caller left) may
have run and admitted it all the same: what it took is given back by ``UNDO`` once Redis
answers again. Each check leaves a marker in Redis when it admits (one key per check, kept for
the lease TTL), so the undo gives back exactly what it took, once however often it is sent,
and a check that reaches Redis after its undo takes nothing. Undos wait in memory while Redis
is away (at most ``MAX_UNDOS``; past that the oldest are dropped, counted in
``llm_gateway_limits_undos_dropped_total``: their leases and holds expire after the lease TTL,
the buckets drain).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.limits import lua
from gateway.limits.redis_pipe import Arg, Script, ScriptPipe
from gateway.limits.store import (
    HELD,
    MICRO,
    SPEND,
    AcquireRequest,
    AcquireResult,
    Blocker,
    LimitCounts,
    ScriptError,
    SettleRequest,
    StoreUnavailable,
    UsageAdd,
    lease_ids,
)

log = logging.getLogger("llm_gateway.limits")

_ERRORS = (RedisError, OSError, TimeoutError)
_BLOCKERS: dict[int, Blocker | None] = {0: None, 1: "bucket", 2: "slot", 3: "budget"}
_MICRO = MICRO  # pUSD per micro-dollar: money is sent and stored as (micro, pUSD rest)
_ACQUIRE, _SETTLE, _RENEW, _UNDO = (
    Script.of(getattr(lua, name), name) for name in ("ACQUIRE", "SETTLE", "RENEW", "UNDO")
)
MAX_UNDOS = 10_000  # undos of lost checks waiting for Redis (module comment)
_Undo = tuple[list[str], list[Arg]]


def _settle_call(req: SettleRequest) -> tuple[list[str], list[Arg]]:
    """The keys and arguments of one SETTLE script call."""
    groups: list[tuple[list[UsageAdd], tuple[tuple[str, int], ...]]] = []
    for add in req.usage:  # a request's day, week and month records share their fields
        if groups and groups[-1][1] == add.fields:
            groups[-1][0].append(add)
        else:
            groups.append(([add], add.fields))
    keys = [a.key for a in req.adjusts] + list(req.releases)
    for hold in req.holds:
        keys += [hold.record, hold.key]
    keys += [u.key for u in req.usage]
    if req.id:
        keys.append(req.done_key)
    args: list[Arg] = [_arg(req.now_ms), len(req.adjusts), len(req.releases)]
    args += [req.lease_id, req.id, len(groups), len(req.holds)]
    for adj in req.adjusts:
        args += [adj.rate.limit, adj.rate.period_ms, adj.delta]
    for hold in req.holds:
        args += [hold.member, hold.amount // _MICRO]
    for records, fields in groups:
        args += [len(records), *(r.keep_s for r in records), len(fields)]
        for name, value in fields:
            if name.endswith("$"):
                args += [name, *divmod(value, _MICRO)]
            else:
                args += [name, value, 0]
    return keys, args


def _undo_call(req: AcquireRequest, mark: str) -> _Undo:
    """The keys and arguments of the UNDO of the check ``req`` that left ``mark``."""
    leases = sorted({lease for s in req.slots for lease in lease_ids(req.lease_id, s.count)})
    keys = [mark, *(b.key for b in req.buckets), *(s.key for s in req.slots)]
    args: list[Arg] = [_arg(req.now_ms), len(req.buckets), len(req.slots), " ".join(leases)]
    args.append(req.lease_ttl_ms)
    hold = req.budget.hold if req.budget is not None else None
    if hold is not None:
        keys += [hold.record, hold.key]
        args += [hold.member, hold.amount // _MICRO]
    else:
        args += ["", 0]
    for b in req.buckets:
        args += [b.rate.limit, b.rate.period_ms, b.amount]
    return keys, args


def _arg(value: int | None) -> int | str:
    return "" if value is None else value


class RedisLimitStore:
    kind: Literal["memory", "redis"] = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.05,
        retry_after_s: float = 1.0,
        connections: int = 4,
        counts: LimitCounts | None = None,  # the limiter's: ``undos_dropped``
    ) -> None:
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._pipe = ScriptPipe(url, timeout_s=timeout_s, connections=connections)
        # Reports (admin, not the request path) use a connection of their own.
        self._redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=1.0, socket_timeout=5.0, max_connections=2
        )
        self._down_since: float | None = None
        self._retry_at = 0.0
        self.failures = 0
        self.script_errors = 0
        self._script_errors_seen: set[str] = set()  # kinds logged (script and message)
        # Checks whose answers were lost, to give back (module comment); each check's marker.
        self._undos: collections.deque[_Undo] = collections.deque()
        self._undo_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.counts = LimitCounts() if counts is None else counts
        self._mark_prefix = os.urandom(6).hex()
        self._marks = itertools.count()

    def set_timeout(self, timeout_s: float) -> None:
        """A reload's ``timeout_ms``: the next calls wait this long (the connections stay)."""
        self.timeout_s = self._pipe.timeout_s = timeout_s

    async def acquire(self, req: AcquireRequest) -> AcquireResult:
        keys: list[str] = [b.key for b in req.buckets] + [s.key for s in req.slots]
        args: list[Arg] = [_arg(req.now_ms), len(req.buckets), len(req.slots)]
        args += [req.lease_id, req.lease_ttl_ms]
        gate = req.budget
        if gate is not None:
            keys += [gate.key, gate.key + ":h"]
            args += [*divmod(gate.cap, _MICRO), 1 if gate.refuse else 0]
            hold = gate.hold
            if hold is not None:
                args += [hold.amount // _MICRO, hold.member, gate.keep_s]
            else:
                args += [0, "", 0]
        else:
            args += ["", 0, 0, 0, "", 0]
        # The check's marker: a key of the tenant's (after its first key's hash tag).
        mark = f"{keys[0]}:a:{self._mark_prefix}-{next(self._marks)}" if keys else ""
        args.append(1 if mark else "")
        for b in req.buckets:
            args += [b.rate.limit, b.rate.period_ms, b.amount]
        for s in req.slots:
            args += [s.limit, s.count]
        if not mark:  # takes nothing: nothing to give back
            raw: list[int] | int = await self._call(_ACQUIRE, keys, args)
        else:
            keys.append(mark)
            try:
                raw = await self._call(
                    _ACQUIRE, keys, args, functools.partial(self._left, req, mark)
                )
            except StoreUnavailable as exc:
                if exc.maybe_applied:  # timed out, connection lost: it may have admitted
                    self._undo_later(req, mark)
                raise
        if not isinstance(raw, list):  # undone before it ran: only a caller gone sees that
            raise StoreUnavailable("this check was given up before it ran")
        nb = len(req.buckets)
        admitted, now, blocker, index, wait, spend_u, spend_p, over, held_u = raw[:9]
        return AcquireResult(
            admitted=admitted == 1,
            now_ms=now,
            debts=tuple(raw[9 : 9 + nb]),
            held=tuple(raw[9 + nb :]),
            spend=int(spend_u) * _MICRO + spend_p,
            blocked_by=_BLOCKERS[blocker],
            blocked_index=max(0, index - 1),
            wait_ms=None if wait == -1 else wait,
            over_budget=over == 1,
            budget_held=int(held_u) * _MICRO,
        )

    def _left(self, req: AcquireRequest, mark: str, reply: asyncio.Future[Any]) -> None:
        """The caller of ``acquire`` left (cancelled) while its script was on its way: if the
        script admitted it, or may have (its answer lost), what it took goes back (its tokens
        and requests to the buckets, every lease it added released, a grant's too, and its
        budget hold), so a client that gives up during a slow check does not hold a
        ``max_concurrent`` slot until the lease expires."""
        if reply.cancelled():
            return
        exc = reply.exception()
        if exc is not None:
            if isinstance(exc, StoreUnavailable) and exc.maybe_applied:
                self._undo_later(req, mark)
            return
        raw = reply.result()
        if isinstance(raw, list) and raw[0] == 1:
            self._undo_later(req, mark)

    def _undo_later(self, req: AcquireRequest, mark: str) -> None:
        """Give back what the check ``req`` took, if it did, once Redis answers (at once
        unless the store is in its back-off)."""
        self._keep_undo(_undo_call(req, mark))
        self._undo_soon(max(0.0, self._retry_at - time.monotonic()))

    def _keep_undo(self, undo: _Undo) -> None:
        if len(self._undos) >= MAX_UNDOS:
            self._undos.popleft()  # its leases and hold expire, its units drain
            self.counts.undos_dropped += 1
        self._undos.append(undo)

    def _undo_soon(self, delay: float) -> None:
        if self._undo_timer is None and self._undos and not self._closed:
            loop = asyncio.get_running_loop()
            self._undo_timer = loop.call_later(delay, self._send_undos)

    def _send_undos(self) -> None:
        """Send the waiting undos (each is idempotent: one that fails is kept and sent again)."""
        self._undo_timer = None
        wait = self._retry_at - time.monotonic()
        if self._down_since is not None and wait > 0:
            self._undo_soon(wait)
            return
        undos, self._undos = self._undos, collections.deque()
        while undos:
            undo = undos.popleft()
            try:
                reply = self._pipe.submit(_UNDO, *undo)
            except StoreUnavailable:  # too many calls waiting: later
                self._keep_undo(undo)
                for rest in undos:
                    self._keep_undo(rest)
                break
            reply.add_done_callback(functools.partial(self._undone, undo))
        self._undo_soon(self.retry_after_s)

    def _undone(self, undo: _Undo, reply: asyncio.Future[Any]) -> None:
        exc = ConnectionError("cancelled") if reply.cancelled() else reply.exception()
        if exc is None or isinstance(exc, ScriptError):
            return  # done (a script error is logged as the bug it is: not sent again)
        self._keep_undo(undo)
        self._undo_soon(self.retry_after_s)

    async def settle(self, req: SettleRequest) -> tuple[int, ...] | None:
        raw: list[int] | int = await self._call(_SETTLE, *_settle_call(req))
        if not isinstance(raw, list):
            return None  # this settlement had run already: its answer was lost on the way
        # Micro-dollars come as decimal strings (``gateway.limits.lua``: money is never a double).
        return tuple(int(raw[i]) * _MICRO + int(raw[i + 1]) for i in range(0, len(raw), 2))

    async def renew(
        self, leases: tuple[tuple[str, str], ...], ttl_ms: int, now_ms: int | None
    ) -> None:
        if not leases:
            return
        keys = [key for key, _ in leases]
        args: list[Arg] = [_arg(now_ms), ttl_ms, *(lease for _, lease in leases)]
        await self._call(_RENEW, keys, args)

    async def _report(self, script: str, *keys_then_args: Arg) -> Any:
        """A report's script (two keys), on the reports' own connection: one that Redis closed
        since (a restart) is tried once more on a fresh one (the first report after a restart
        was a 503)."""
        try:
            return await self._redis.eval(script, 2, *keys_then_args)
        except RedisConnectionError:
            return await self._redis.eval(script, 2, *keys_then_args)

    async def read_usage(self, key: str, now_ms: int | None = None) -> dict[str, int]:
        """The record's fields; its ``held$`` what the holds still live hold (those expired,
        their holder gone, are left out before the next check reclaims them)."""
        try:
            raw = await self._report(lua.READ, key, key + ":h", _arg(now_ms))
        except _ERRORS as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from exc
        *flat, held_text = raw
        out: dict[str, int] = {}
        held = int(held_text)
        if held > 0:
            out[HELD] = held * _MICRO
        for name_raw, value in zip(flat[::2], flat[1::2], strict=True):
            name = name_raw.decode() if isinstance(name_raw, bytes) else name_raw
            if name == HELD + ".u":
                continue
            if name.endswith(("$.u", "$.p")):
                money = name[:-2]
                scale = _MICRO if name.endswith(".u") else 1
                out[money] = out.get(money, 0) + int(value) * scale
            else:
                out[name] = int(value)
        out.setdefault(SPEND, 0)
        return out

    async def aclose(self) -> None:
        if self._undo_timer is not None:
            self._undo_timer.cancel()
            self._undo_timer = None
        if self._undos and self.available:
            self._send_undos()  # a last try (the pipe waits for the calls in flight)
        self._closed = True
        if self._undo_timer is not None:
            self._undo_timer.cancel()
            self._undo_timer = None
        await self._pipe.aclose()
        await self._redis.aclose()

    def on_trouble(self, react: Callable[[], None]) -> None:
        """Call ``react`` as soon as Redis closes a connection or a call fails."""
        self._pipe.on_trouble = react

    @property
    def available(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._retry_at

    async def _call(
        self,
        script: Script,
        keys: list[str],
        args: list[Arg],
        left: Callable[[asyncio.Future[Any]], None] | None = None,
    ) -> Any:
        """One script call. With ``left``: a caller that leaves (cancelled) before the reply
        does not drop it, ``left`` gets it (shielded: a future and two callbacks, no task)."""
        if self._down_since is not None and time.monotonic() < self._retry_at:
            raise StoreUnavailable("redis limit store is in back-off")
        try:
            reply = self._pipe.submit(script, keys, args)
            if left is None:
                result = await reply
            else:
                try:
                    result = await asyncio.shield(reply)
                except asyncio.CancelledError:
                    reply.add_done_callback(left)
                    raise
        except ScriptError as exc:
            self._script_failed(script, exc)
            raise
        except StoreUnavailable as exc:
            self._failed(exc)
            raise
        if self._down_since is not None:
            log.warning("redis limit store back after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        return result

    def _script_failed(self, script: Script, exc: ScriptError) -> None:
        self.script_errors += 1
        kind = f"{script.name}: {exc}"
        if kind not in self._script_errors_seen and len(self._script_errors_seen) < 64:
            self._script_errors_seen.add(kind)
            log.error("limit script %s failed, for this call only: %s", script.name, exc)

    def _failed(self, exc: StoreUnavailable) -> None:
        self.failures += 1
        self._retry_at = time.monotonic() + self.retry_after_s
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("redis limit store unavailable (%s)", exc)
