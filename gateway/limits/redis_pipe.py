"""Script calls to Redis, pipelined: the calls waiting when a connection frees go in one write.

Why: under a burst, one round trip per call would queue thousands of calls for a pooled
connection, and each call's time-out would then measure that queue, not Redis: a burst would
read as an outage, and the limits would fail open exactly when they matter. Here calls wait
in the process; at most ``connections`` batches are in flight, each one write of up to
``max_batch`` EVALSHAs followed by their replies, under ``timeout_s`` from the moment it is
sent. Each script still runs atomically on the server; batching changes only the transport.
Every call is written at once when a connection is free (settlements too: made to wait ~2 ms
for company, they were written in the middle of the next request and cost it ~0.1 ms at
concurrency 1 here); a check finds another connection while a settlement is in flight.

The transport is an asyncio protocol of our own over hiredis's reply parser (``_Link``), not
redis-py's connection: a batch is written from the caller's own step and its replies are
handed out from the protocol's ``data_received``, with no task, stream reader or timeout
context per batch. A limit check is on every limited request's path, and on this project's
machine that machinery cost ~0.2 ms per call when the cores had been idle for a few
milliseconds (an EVALSHA of ``return 1``: 0.31-0.48 ms p50 through redis-py's connection, 0.29-0.31
ms through the protocol, 0.16-0.28 ms for a bare PING). redis-py still parses the URL
(``redis://``, ``rediss://``, ``unix://``; user, password and database are sent on connect).

A failed batch says whether its calls may have run (``maybe_applied``): one that failed before
it was written did not run; one that failed after (connection lost, time-out) may have.

Scripts travel as ``EVALSHA`` while the server is known to hold them, else as ``EVAL`` with
their text (which caches them): at start, after a connection was lost (the server may have
restarted empty) and after any ``NOSCRIPT`` (the cache was flushed: every script is gone). A
call answered ``NOSCRIPT`` did not run: it is sent again whole on its connection, a round
trip later, and calls made meanwhile may overtake it. Only calls in flight at a flush meet
it (before, each script's first call after it did, and a settlement so delayed was overtaken
by its client's next check: a refused "request in flight" under ``max_concurrent: 1``). A
settlement is written as its request ends, before that client's next request can reach its
check, so only a flush between a request's check and its settlement still puts it behind.

A refusal that is Redis unavailable, not a bug of ours (out of memory, a read-only replica
after a failover, credentials it wants or refuses, still loading, busy with another script:
``OUTAGES``), fails its call as an outage does, logged by the store once per outage; any other
error a script returns fails that call alone (``ScriptError``: a bug of ours, or an input the
script cannot take), logged by the store once per kind.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ResponseError

from gateway.limits.store import ScriptError, StoreUnavailable

Arg = int | str

# Error codes Redis refuses a call with while it cannot serve it: an outage, not our bug.
OUTAGES = frozenset(
    {
        "OOM",  # used memory > maxmemory (noeviction): writes refused
        "READONLY",  # a replica (after a failover, the old primary)
        "MASTERDOWN",  # a replica that lost its primary (replica-serve-stale-data no)
        "NOAUTH",  # a password is wanted (set since we connected, or missing from the URL)
        "WRONGPASS",
        "NOPERM",  # an ACL user not allowed our commands or keys
        "LOADING",  # loading its dataset after a restart
        "BUSY",  # running another (long) script
        "MISCONF",  # cannot persist (stop-writes-on-bgsave-error)
        "CLUSTERDOWN",
        "TRYAGAIN",
        "NOREPLICAS",
    }
)


def error_code(error: Exception) -> str:
    """The code a Redis error reply begins with (``WRONGPASS``, ``OOM``, ``ERR``), never the
    rest of the message (it may quote what was sent); "" when it has none."""
    word = str(error).split(" ", 1)[0]
    return word if word.isupper() and word.isalpha() else ""


def is_outage(error: Exception) -> bool:
    """Redis refused the call because it cannot serve it now (``OUTAGES``; an unauthenticated
    connection's command cut short is ``ERR Protocol error: unauthenticated ...``)."""
    return error_code(error) in OUTAGES or "unauthenticated" in str(error)


@dataclass(frozen=True, slots=True)
class Script:
    text: str
    sha: str
    name: str = "script"  # for the logs

    @classmethod
    def of(cls, text: str, name: str = "script") -> Script:
        return cls(text, hashlib.sha1(text.encode()).hexdigest(), name)

    @property
    def sha_bytes(self) -> bytes:
        return self.sha.encode()

    @property
    def text_bytes(self) -> bytes:
        return self.text.encode()


@dataclass(slots=True)
class _Call:
    script: Script
    keys: list[str]
    args: list[Arg]
    future: asyncio.Future[Any]


class _Link(asyncio.Protocol):
    """One connection: one exchange (a write, then a known number of replies) at a time."""

    def __init__(self, on_lost: Callable[[], None] = lambda: None) -> None:
        self._parser = hiredis.Reader(replyError=ResponseError)
        self._transport: asyncio.Transport | None = None
        self._expected = 0
        self._replies: list[Any] = []
        self._done: asyncio.Future[list[Any]] | None = None
        self._on_reply: Callable[[int, Any], None] | None = None
        self._on_lost = on_lost  # the server closed it (not us): it may be gone
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        done = self._done
        while done is not None and len(self._replies) < self._expected:
            reply = self._parser.gets()
            if reply is False:
                return
            self._replies.append(reply)
            if self._on_reply is not None:
                self._on_reply(len(self._replies) - 1, reply)
        if done is not None and not done.done():
            self._done = None
            done.set_result(self._replies)

    def connection_lost(self, exc: Exception | None) -> None:
        ours = self.lost  # close() marks it first
        self.lost = True
        self._fail(ConnectionError(f"connection lost: {exc}" if exc else "connection closed"))
        if not ours:
            self._on_lost()

    def _fail(self, exc: Exception) -> None:
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.set_exception(exc)

    def exchange(
        self, payload: bytes, replies: int, on_reply: Callable[[int, Any], None] | None = None
    ) -> asyncio.Future[list[Any]]:
        """Write ``payload`` now; the future gets its ``replies`` replies, in order, and
        ``on_reply`` each one (with its index) as soon as it is read."""
        assert self._transport is not None
        assert self._done is None
        self._expected, self._replies, self._on_reply = replies, [], on_reply
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(payload)
        return self._done

    def expire(self) -> None:
        """The exchange ran past its time: fail it; the connection is out of step, close it."""
        self._fail(TimeoutError("redis did not answer in time"))
        self.close()

    def close(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.abort()


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join([b"$%d\r\n%s\r\n" % (len(p), p) for p in parts])


@dataclass
class ScriptPipe:
    url: str
    timeout_s: float = 0.05
    connections: int = 4
    max_batch: int = 256
    max_queue: int = 50_000
    _queue: collections.deque[_Call] = field(default_factory=collections.deque)
    _in_flight: int = 0
    # Told at once when Redis closes a connection or a call fails: it may be gone (the
    # limiter then stops admitting from grants, and finds out with its next check).
    on_trouble: Callable[[], None] = lambda: None

    def __post_init__(self) -> None:
        self._options: dict[str, Any] = dict(parse_url(self.url))
        self._idle: list[_Link] = []
        self._connecting: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Future[list[Any]]] = set()
        self._known: set[str] = set()  # shas of the scripts the server holds (module comment)
        self.batches = 0  # writes sent (each with up to max_batch calls)

    async def call(self, script: Script, keys: list[str], args: list[Arg]) -> Any:
        return await self.submit(script, keys, args)

    def submit(self, script: Script, keys: list[str], args: list[Arg]) -> asyncio.Future[Any]:
        """Queue a call (written at once if a connection is free); its reply, or its failure."""
        if len(self._queue) >= self.max_queue:
            raise StoreUnavailable("too many calls waiting for redis")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call(script, keys, args, future))
        self._pump()
        return future

    async def aclose(self) -> None:
        while self._exchanges or self._connecting is not None:
            if self._connecting is not None:
                await asyncio.gather(self._connecting, return_exceptions=True)
            if self._exchanges:
                await asyncio.gather(*list(self._exchanges), return_exceptions=True)
            await asyncio.sleep(0)  # let the exchanges' callbacks run
        for link in self._idle:
            link.close()
        self._idle.clear()

    def _pump(self) -> None:
        while self._queue:
            if self._idle:
                link = self._idle.pop()
                if link.lost:
                    continue
                count = min(self.max_batch, len(self._queue))
                self._send(link, [self._queue.popleft() for _ in range(count)])
            elif self._in_flight < self.connections and self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
                return
            else:
                return

    async def _connect(self) -> None:
        try:
            link = await self._open()
        except Exception as exc:  # whatever it was, the waiting calls must fail
            # Nothing was sent: every call waiting now fails at once (the store backs off).
            self.on_trouble()
            # A refusal is named by its code (WRONGPASS, NOAUTH...): never the URL's credentials.
            code = error_code(exc) if isinstance(exc, ResponseError) else ""
            failed = StoreUnavailable(f"redis: {code or type(exc).__name__}")
            while self._queue:
                call = self._queue.popleft()
                if not call.future.done():
                    call.future.set_exception(failed)
            return
        finally:
            self._connecting = None
        self._idle.append(link)
        self._pump()

    async def _open(self) -> _Link:
        options = self._options
        loop = asyncio.get_running_loop()

        links: list[_Link] = []

        def made() -> _Link:
            links.append(_Link(self._lost))
            return links[-1]

        try:
            return await self._handshake(made, options, loop)
        except BaseException:
            # Timed out or refused mid-way (AUTH to a server that accepts connections but does
            # not answer): the connection must not outlive the attempt.
            for link in links:
                link.close()
            raise

    async def _handshake(
        self, made: Callable[[], _Link], options: dict[str, Any], loop: asyncio.AbstractEventLoop
    ) -> _Link:
        async with asyncio.timeout(max(self.timeout_s, 0.2)):
            link: _Link
            if options.get("connection_class") is UnixDomainSocketConnection:
                _, link = await loop.create_unix_connection(made, options["path"])
            else:
                context = None
                if options.get("connection_class") is SSLConnection:
                    context = ssl.create_default_context()
                    if options.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                        context.check_hostname = False
                        context.verify_mode = ssl.CERT_NONE
                host, port = options.get("host", "localhost"), options.get("port", 6379)
                _, link = await loop.create_connection(made, host, port, ssl=context)
            hello: list[bytes] = []
            if options.get("password"):
                user = options.get("username")
                auth = [b"AUTH", *([user.encode()] if user else []), options["password"].encode()]
                hello.append(_command(*auth))
            if options.get("db"):
                hello.append(_command(b"SELECT", str(options["db"]).encode()))
            if hello:
                for reply in await link.exchange(b"".join(hello), len(hello)):
                    if isinstance(reply, ResponseError):
                        raise reply
        return link

    def _lost(self) -> None:
        """The server closed a connection: it may come back empty (a restart)."""
        self._known.clear()
        self.on_trouble()

    def _send(self, link: _Link, batch: list[_Call]) -> None:
        """Write ``batch`` on ``link``, from this step; each call gets its reply as soon as it
        is read."""
        parts = []
        with_text: set[str] = set()  # scripts this write sends whole (then known to the server)
        for call in batch:
            sha = call.script.sha
            whole = sha not in self._known and sha not in with_text
            if whole:
                with_text.add(sha)
            parts.append(_pack(call, whole))
        payload = b"".join(parts)
        self._in_flight += 1
        self.batches += 1
        missing: list[_Call] = []  # calls of scripts the server did not hold: not run

        def on_reply(index: int, reply: Any) -> None:
            call = batch[index]
            if isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT"):
                self._known.clear()  # the cache was flushed: every script is gone
                missing.append(call)
                return
            self._known.add(call.script.sha)
            _deliver(call, reply)

        exchange = link.exchange(payload, len(batch), on_reply)
        timer = asyncio.get_running_loop().call_later(self.timeout_s, link.expire)
        self._exchanges.add(exchange)
        exchange.add_done_callback(functools.partial(self._answered, link, batch, missing, timer))

    def _answered(
        self,
        link: _Link,
        batch: list[_Call],
        missing: list[_Call],
        timer: asyncio.TimerHandle,
        exchange: asyncio.Future[list[Any]],
    ) -> None:
        timer.cancel()
        self._exchanges.discard(exchange)
        self._in_flight -= 1
        exc = ConnectionError("closed") if exchange.cancelled() else exchange.exception()
        if exc is not None:
            self._known.clear()  # the server may be gone, and come back empty
            self.on_trouble()
            link.close()
            # The idle ones most likely lost their server too (a restart): reconnect afresh
            # rather than find out one back-off window at a time.
            idle, self._idle = self._idle, []
            for other in idle:
                other.close()
            # The calls whose replies came were answered; the others were sent and may have run.
            failed = StoreUnavailable(f"redis: {type(exc).__name__}", maybe_applied=True)
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(failed)
        elif missing:
            # Sent again whole (``_known`` was cleared), in their order, on this connection.
            self._send(link, missing)
        else:
            self._idle.append(link)
        self._pump()


def _deliver(call: _Call, reply: Any) -> None:
    if call.future.done():
        return  # its caller went away; the script ran all the same
    if isinstance(reply, ResponseError):
        if is_outage(reply):
            # Redis cannot serve it now (refused before the script ran, or at its first write:
            # nothing taken): an outage, which the store logs once.
            code = error_code(reply) or "unauthenticated"
            call.future.set_exception(StoreUnavailable(f"redis refused: {code}"))
            return
        # This call's own failure (a bug of ours, or an input it cannot take), not an outage.
        call.future.set_exception(ScriptError(f"redis script error: {reply}"))
    else:
        call.future.set_result(reply)


def _pack(call: _Call, whole: bool = False) -> bytes:
    """One EVALSHA in RESP (``whole``: an EVAL with the script's text). Ours rather than
    redis-py's generic packer, which costs about 0.6 us per argument (type checks, encoders)
    where this costs a third of it: a settlement has some 40 arguments, and every request sends
    one besides its check."""
    data = [str(len(call.keys)).encode()]
    data += [k.encode() for k in call.keys]
    data += [a.encode() if isinstance(a, str) else b"%d" % a for a in call.args]
    if whole:
        text = call.script.text_bytes
        head = b"*%d\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n" % (len(data) + 2, len(text), text)
    else:
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % (len(data) + 2, call.script.sha_bytes)
    return head + b"".join([b"$%d\r\n%s\r\n" % (len(d), d) for d in data])
