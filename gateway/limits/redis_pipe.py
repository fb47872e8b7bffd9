"""Script calls to Redis, pipelined: the calls waiting when a connection frees go in one write.

Why: under a burst, one round trip per call would queue thousands of calls for a pooled
connection, and each call's time-out would then measure that queue, not Redis: a burst would
read as an outage, and the limits would fail open exactly when they matter. Here calls wait
in the process; at most ``connections`` batches are in flight, each one write of up to
``max_batch`` EVALSHAs followed by their replies, under ``timeout_s`` from the moment it is
sent. Each script still runs atomically on the server; batching changes only the transport.
A call that nobody waits on (a settlement, after its answer went out) may ``linger`` a couple
of milliseconds so that the settlements of consecutive requests share one write; a check
never waits.

A failed batch says whether its calls may have run (``maybe_applied``): a failure before the
write completed means none did; one while reading the replies means any may have. A script
the server does not know (NOSCRIPT, after a restart) did not run: it is loaded and those
calls are sent again. redis-py's own retries are off (a blind retry could run a script twice).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError, RedisError, ResponseError

from gateway.limits.store import StoreUnavailable

log = logging.getLogger("llm_gateway.limits")

Arg = int | str
_TRANSPORT_ERRORS = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Script:
    text: str
    sha: str

    @classmethod
    def of(cls, text: str) -> Script:
        return cls(text, hashlib.sha1(text.encode()).hexdigest())

    @property
    def sha_bytes(self) -> bytes:
        return self.sha.encode()


@dataclass(slots=True)
class _Call:
    script: Script
    keys: list[str]
    args: list[Arg]
    future: asyncio.Future[Any]


@dataclass(slots=True)
class _Sent:
    done: bool = False


@dataclass
class ScriptPipe:
    url: str
    timeout_s: float = 0.05
    connections: int = 4
    max_batch: int = 256
    max_queue: int = 50_000
    _queue: collections.deque[_Call] = field(default_factory=collections.deque)
    _in_flight: int = 0

    def __post_init__(self) -> None:
        # The pool only makes connections: each batch in flight holds one of ours (at most
        # ``connections``), so there is nothing to wait for and no pool lock on the way.
        # No socket_timeout: redis-py would wrap every write in a task (asyncio.wait_for) and
        # every read in a timer; the batch's own timeout bounds both.
        self._factory = aioredis.ConnectionPool.from_url(
            self.url, socket_connect_timeout=max(self.timeout_s, 0.2), socket_timeout=None
        )
        self._idle: list[AbstractConnection] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.batches = 0  # writes sent (each with up to max_batch calls)

    async def call(
        self, script: Script, keys: list[str], args: list[Arg], linger_s: float = 0.0
    ) -> Any:
        if len(self._queue) >= self.max_queue:
            raise StoreUnavailable("too many calls waiting for redis")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Call(script, keys, args, future))
        if linger_s <= 0:
            self._pump()
        elif self._timer is None:
            self._timer = loop.call_later(linger_s, self._pump)
        return await future

    async def aclose(self) -> None:
        self._pump()  # what lingers goes now
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for conn in self._idle:
            await conn.disconnect()
        self._idle.clear()
        await self._factory.aclose()

    def _pump(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._in_flight < self.connections and self._queue:
            count = min(self.max_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(count)]
            self._in_flight += 1
            self.batches += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            await self._exchange(batch)
        finally:
            self._in_flight -= 1
            self._pump()

    async def _exchange(self, batch: list[_Call]) -> None:
        sent = _Sent()
        conn = self._idle.pop() if self._idle else self._factory.make_connection()  # type: ignore[no-untyped-call]
        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await _roundtrip(conn, batch, sent)
                missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                if missing:
                    for script in {batch[i].script for i in missing}:
                        await conn.send_command("SCRIPT", "LOAD", script.text)
                        await conn.read_response()
                    again = await _roundtrip(conn, [batch[i] for i in missing], _Sent())
                    for i, reply in zip(missing, again, strict=True):
                        replies[i] = reply
        except (*_TRANSPORT_ERRORS, asyncio.CancelledError) as exc:
            await conn.disconnect(nowait=True)  # mid-exchange: its replies may be out of step
            # The idle ones most likely lost their server too (a restart): reconnect afresh
            # rather than find out one back-off window at a time.
            idle, self._idle = self._idle, []
            for other in idle:
                await other.disconnect(nowait=True)
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(
                        StoreUnavailable(f"redis: {type(exc).__name__}", maybe_applied=sent.done)
                    )
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._idle.append(conn)
        for c, reply in zip(batch, replies, strict=True):
            if c.future.done():
                continue  # its caller went away; the script ran all the same
            if isinstance(reply, ResponseError):
                # A script error is a bug of ours, not an outage: say so loudly.
                log.error("limit script failed: %s", reply)
                c.future.set_exception(StoreUnavailable(f"redis script error: {reply}"))
            else:
                c.future.set_result(reply)


def _pack(call: _Call) -> bytes:
    """One EVALSHA in RESP. Ours rather than redis-py's generic packer, which costs about
    0.6 us per argument (type checks, encoders) where this costs a third of it: a settlement
    has some 40 arguments, and every request sends one besides its check."""
    data = [str(len(call.keys)).encode()]
    data += [k.encode() for k in call.keys]
    data += [a.encode() if isinstance(a, str) else b"%d" % a for a in call.args]
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % (len(data) + 2, call.script.sha_bytes)
    return head + b"".join([b"$%d\r\n%s\r\n" % (len(d), d) for d in data])


async def _roundtrip(conn: AbstractConnection, batch: list[_Call], sent: _Sent) -> list[Any]:
    await conn.send_packed_command(b"".join(_pack(c) for c in batch))
    sent.done = True
    replies: list[Any] = []
    for _ in batch:
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies
