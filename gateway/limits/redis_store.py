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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.limits import lua
from gateway.limits.redis_pipe import Arg, Script, ScriptPipe
from gateway.limits.store import (
    MICRO,
    SPEND,
    AcquireRequest,
    AcquireResult,
    Blocker,
    BucketAdjust,
    SettleRequest,
    StoreUnavailable,
    UsageAdd,
    lease_ids,
)

log = logging.getLogger("llm_gateway.limits")

_ERRORS = (RedisError, OSError, TimeoutError)
_BLOCKERS: dict[int, Blocker | None] = {0: None, 1: "bucket", 2: "slot", 3: "budget"}
_MICRO = MICRO  # pUSD per micro-dollar: money is sent and stored as (micro, pUSD rest)
_ACQUIRE, _SETTLE, _RENEW = (Script.of(text) for text in (lua.ACQUIRE, lua.SETTLE, lua.RENEW))


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


def _retrieved(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled():
        reply.exception()  # looked at: a failed give-back is not worth a log line


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
        for b in req.buckets:
            args += [b.rate.limit, b.rate.period_ms, b.amount]
        for s in req.slots:
            args += [s.limit, s.count]
        left = functools.partial(self._give_back, req)
        raw: list[int] = await self._call(_ACQUIRE, keys, args, left)
        nb = len(req.buckets)
        admitted, now, blocker, index, wait, spend_u, spend_p, over, held_u = raw[:9]
        return AcquireResult(
            admitted=admitted == 1,
            now_ms=now,
            debts=tuple(raw[9 : 9 + nb]),
            held=tuple(raw[9 + nb :]),
            spend=spend_u * _MICRO + spend_p,
            blocked_by=_BLOCKERS[blocker],
            blocked_index=max(0, index - 1),
            wait_ms=None if wait == -1 else wait,
            over_budget=over == 1,
            budget_held=held_u * _MICRO,
        )

    def _give_back(self, req: AcquireRequest, reply: asyncio.Future[Any]) -> None:
        """The caller of ``acquire`` left (cancelled) while its script was on its way: if the
        script admitted it, what it took goes back (its tokens and requests to the buckets,
        every lease it added released, a grant's too, and its budget hold), so a client that
        gives up during a slow check does not hold a ``max_concurrent`` slot until the lease
        expires. One call, not awaited: should it fail, the leases and the hold expire and the
        buckets drain on their own."""
        if reply.cancelled() or reply.exception() is not None or reply.result()[0] != 1:
            return
        leases = {lease for s in req.slots for lease in lease_ids(req.lease_id, s.count)}
        gate = req.budget
        undo = SettleRequest(
            adjusts=tuple(BucketAdjust(b.key, b.rate, -b.amount) for b in req.buckets),
            releases=tuple(s.key for s in req.slots),
            lease_id=" ".join(sorted(leases)),
            now_ms=req.now_ms,
            # Not taken (the budget did not cover it): its member is absent, nothing released.
            holds=(gate.hold,) if gate is not None and gate.hold is not None else (),
        )
        with contextlib.suppress(StoreUnavailable):
            self._pipe.submit(_SETTLE, *_settle_call(undo)).add_done_callback(_retrieved)

    async def settle(self, req: SettleRequest) -> tuple[int, ...] | None:
        raw: list[int] | int = await self._call(_SETTLE, *_settle_call(req))
        if not isinstance(raw, list):
            return None  # this settlement had run already: its answer was lost on the way
        return tuple(raw[i] * _MICRO + raw[i + 1] for i in range(0, len(raw), 2))

    async def renew(
        self, leases: tuple[tuple[str, str], ...], ttl_ms: int, now_ms: int | None
    ) -> None:
        if not leases:
            return
        keys = [key for key, _ in leases]
        args: list[Arg] = [_arg(now_ms), ttl_ms, *(lease for _, lease in leases)]
        await self._call(_RENEW, keys, args)

    async def read_usage(self, key: str, now_ms: int | None = None) -> dict[str, int]:
        try:
            raw = await self._redis.hgetall(key)
        except _ERRORS as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from exc
        out: dict[str, int] = {}
        for name_raw, value in raw.items():
            name = name_raw.decode() if isinstance(name_raw, bytes) else name_raw
            if name.endswith(("$.u", "$.p")):
                money = name[:-2]
                scale = _MICRO if name.endswith(".u") else 1
                out[money] = out.get(money, 0) + int(value) * scale
            else:
                out[name] = int(value)
        out.setdefault(SPEND, 0)
        return out

    async def aclose(self) -> None:
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
        except StoreUnavailable as exc:
            self._failed(exc)
            raise
        if self._down_since is not None:
            log.warning("redis limit store back after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        return result

    def _failed(self, exc: StoreUnavailable) -> None:
        self.failures += 1
        self._retry_at = time.monotonic() + self.retry_after_s
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("redis limit store unavailable (%s)", exc)
