"""Bounds on client connections, below the request handlers: aiohttp leaves them to the server.

aiohttp's own defaults hold a connection open 3,630 s between requests, give no deadline for a
request's head, accept as many sockets as the process has file descriptors, and answer a
malformed request with a plain-text 400 that echoes the offending bytes after logging them at
ERROR (an Authorization header over 8 KB, or with a control character, lands in the log and in
the answer). This module replaces its per-connection protocol (``RequestHandler``) with one
that adds, from ``ConnectionLimits``:

- a head deadline (``server.header_timeout_s``): from a connection's start, or from the first byte of
  each later request, the whole request line and headers must arrive in time; else 408 (when
  bytes came) and close. Slowloris connections end here.
- idle keep-alive (``server.keepalive_timeout_s``): aiohttp's timer, with a bound that suits proxies
  and LBs. It closes a connection idle between requests only: while a head is awaited (a new
  connection's first) or arriving, the head deadline governs, so a keep-alive bound shorter than
  the head deadline neither cuts a head still coming nor closes it without its 408.
- a cap on open connections (``server.max_client_connections``): at the cap, a new connection closes the
  oldest idle one, else the one that has been sending its body longest, past ``SLOW_BODY_S``
  (a slow upload under a full house is shed before a new client is refused); when none
  qualifies, the new one gets a 503 in OpenAI's error JSON and is closed. Idle means a
  keep-alive socket between requests, or one whose awaited head (its first request's, or a
  later one's since its first byte) has been coming for ``SLOW_HEAD_S``. A connection just
  accepted has not had time to send its request: closing it would answer a burst of clients
  arriving together at the cap with bare disconnects, each new one closing the one before
  it, where the 503 tells them to retry. Past ``SLOW_HEAD_S`` it is shed (a client that
  connects and says nothing, a slow-header flood), so idle, slow-header and slow-body floods
  cannot lock out a real client for longer than that. The cap never exceeds what the
  open-file limit leaves room for (one client and one upstream socket per connection, plus a
  reserve).
- parser errors as OpenAI error JSON naming the kind of fault, logged as one line without the
  bytes that caused them.

The body deadline and size are enforced where the body is read (``gateway.protocol.body``; the
server runs with ``auto_decompress=False`` so that bound holds for compressed bodies too). The
limits object is shared and mutable: a policy reload changes the bounds of connections from
then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, InvalidURLError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from gateway.errors import STOPPING, error_bytes
from policies.server import ServerConfig

log = logging.getLogger("llm_gateway.connections")

FD_RESERVE = 64  # files, the listening socket, Redis, telemetry exporters, logs
SLOW_BODY_S = 2.0  # a body still arriving after this may be shed at the connection cap
SLOW_HEAD_S = 2.0  # a head awaited this long may be shed (a client's comes in milliseconds)
CUT_NOTICE_S = 0.5  # at the end of a drain: what a cut request has to tell its client


@dataclass
class ConnectionLimits:
    header_timeout_s: float = 15.0
    keepalive_s: float = 75.0
    max_connections: int = 1024

    @classmethod
    def of(cls, server: ServerConfig) -> ConnectionLimits:
        limits = cls()
        limits.update(server)
        return limits

    def update(self, server: ServerConfig) -> None:
        """A reload's new bounds, for connections from now on (and head deadlines armed later)."""
        self.header_timeout_s = server.header_timeout_s
        self.keepalive_s = server.keepalive_timeout_s
        self.max_connections = server.max_client_connections

    def effective_max(self) -> int:
        """``max_connections``, lowered to what the open-file limit can hold."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, (soft - FD_RESERVE) // 2))


def raise_file_limit(wanted: int) -> int:
    """Raise the soft open-file limit toward ``wanted`` (up to the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)


def _refusal() -> bytes:
    body = error_bytes(
        "the gateway is at its connection limit (server.max_client_connections); retry shortly",
        "service_unavailable",
        "too_many_connections",
    )
    return _REFUSED % (len(body), body)


class _GuardedServer(Server):
    """aiohttp's Server whose connections are ``GuardedHandler``s sharing ``limits``."""

    limits: ConnectionLimits
    refused: int = 0
    refusal_logged_at: float = float("-inf")

    def __call__(self) -> RequestHandler:
        kwargs = dict(self._kwargs)
        kwargs["keepalive_timeout"] = self.limits.keepalive_s
        return GuardedHandler(self, loop=self._loop, **kwargs)


def _idle(handler: RequestHandler) -> bool:
    """No request is being handled or queued on this connection (aiohttp's own idle test)."""
    return not handler._request_in_progress and not handler._messages


class GuardedHandler(RequestHandler):
    """One client connection: aiohttp's protocol plus the bounds in the module's docstring."""

    def __init__(self, manager: Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.body_since: float | None = None  # loop time the handler began reading the body
        self._head_deadline: asyncio.TimerHandle | None = None
        self.head_since: float | None = None  # loop time the awaited head's wait began
        self._head_count = 0  # requests parsed when the deadline was set
        self._head_bytes = False  # bytes of the awaited head have arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = cast(_GuardedServer, self._manager)
        limit = manager.limits.effective_max()
        if len(manager._connections) >= limit and not _evict_one(manager):
            t = cast(asyncio.Transport, transport)
            t.write(_refusal())
            t.close()
            self._manager = None  # never registered: connection_lost has nothing to undo
            manager.refused += 1
            now = self._loop.time()
            if now - manager.refusal_logged_at >= 10.0:  # one line per 10 s, not per socket
                manager.refusal_logged_at = now
                log.warning(
                    "connections refused at server.max_client_connections (%d open): %d so far",
                    limit,
                    manager.refused,
                )
            return
        super().connection_made(transport)
        self._arm_head_deadline(bytes_seen=False)

    def _arm_head_deadline(self, bytes_seen: bool) -> None:
        manager = cast(_GuardedServer, self._manager)
        self._head_count = self._request_count
        self._head_bytes = bytes_seen
        self.head_since = self._loop.time()
        self._head_deadline = self._loop.call_later(
            manager.limits.header_timeout_s, self._head_deadline_passed
        )

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None:
            if self._request_count == self._head_count and _idle(self) and not self._force_close:
                self._arm_head_deadline(bytes_seen=True)  # the first byte of a new head
        else:
            self._head_bytes = True
        super().data_received(data)
        if self._head_deadline is not None and self._request_count != self._head_count:
            self._head_deadline.cancel()  # the head is complete
            self._head_deadline = None
            self.head_since = None
            self._head_count = self._request_count

    def _process_keepalive(self) -> None:
        if self._head_deadline is not None:  # a head is awaited: its deadline governs
            self._keepalive_handle = None  # aiohttp re-arms it after the next answer
            return
        super()._process_keepalive()

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        self.head_since = None
        if self._request_count != self._head_count or not _idle(self) or self.transport is None:
            return
        if self._head_bytes:
            body = error_bytes(
                "the request head did not arrive within server.header_timeout_s",
                "invalid_request_error",
                "request_timeout",
            )
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's last-resort answer (parser errors, handler crashes): OpenAI JSON, and a
        log line that never carries the request's bytes."""
        kind = type(exc).__name__ if exc is not None else "error"
        if status >= 500:
            log.error("internal error answering %s: %s", request.remote, kind)
            text, type_, code = "internal gateway error", "server_error", "internal_error"
        else:
            if not isinstance(exc, BadHttpMethod):
                log.info("malformed HTTP request from %s: %s", request.remote, kind)
            text, type_, code = _parser_message(exc), "invalid_request_error", "malformed_request"
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; the connection is closed instead")
        resp = web.Response(
            status=status, body=error_bytes(text, type_, code), content_type="application/json"
        )
        resp.force_close()
        return resp


def _parser_message(exc: BaseException | None) -> str:
    if isinstance(exc, LineTooLong):
        return "malformed HTTP request: a request line or header is too long (limit 8190 bytes)"
    if isinstance(exc, InvalidURLError):
        return "malformed HTTP request: the URL is not valid"
    if isinstance(exc, BadHttpMethod):
        return "malformed HTTP request: unknown method"
    return "malformed HTTP request: the request line or a header is not valid HTTP"


def _evictable(handler: RequestHandler) -> bool:
    """Idle between requests, or awaiting a head for ``SLOW_HEAD_S`` (see the module's
    docstring): not a connection whose client has only just connected."""
    if not _idle(handler):
        return False
    since = getattr(handler, "head_since", None)
    return since is None or handler._loop.time() - since >= SLOW_HEAD_S


def _evict_one(manager: Server) -> bool:
    """Close the oldest idle connection (the dict keeps them in the order they opened), else
    the slowest body still arriving after ``SLOW_BODY_S``."""
    slowest: GuardedHandler | None = None
    for handler in manager._connections:
        if handler._force_close:
            continue
        if _evictable(handler):
            handler.force_close()
            return True
        since = getattr(handler, "body_since", None)
        if since is not None and (slowest is None or since < (slowest.body_since or 0.0)):
            slowest = cast(GuardedHandler, handler)
    since = slowest.body_since if slowest is not None else None
    if slowest is not None and since is not None and slowest._loop.time() - since >= SLOW_BODY_S:
        slowest.force_close()
        return True
    return False


@contextlib.contextmanager
def reading_body(request: web.BaseRequest) -> Iterator[None]:
    """Mark the request's connection as receiving its body (see ``_evict_one``)."""
    handler = request.protocol
    if not isinstance(handler, GuardedHandler):
        yield
        return
    handler.body_since = handler._loop.time()
    try:
        yield
    finally:
        handler.body_since = None


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are bounded by ``limits``; request bodies are left
    compressed for ``gateway.protocol.body`` to decode under its bounds."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        # lingering_time: after an answer given before the body was read (413, 408), aiohttp
        # drains the rest so the client sees the answer; 2 s bounds what a slow sender holds.
        super().__init__(
            app,
            keepalive_timeout=limits.keepalive_s,
            auto_decompress=False,
            lingering_time=2.0,
            **kwargs,
        )
        self.limits = limits

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        # Same object, our connection factory: aiohttp builds its Server in private code
        # (Application._make_handler), so the class is narrowed here instead of rebuilt.
        server.__class__ = _GuardedServer
        cast(_GuardedServer, server).limits = self.limits
        return server

    async def drain(self, within_s: float) -> None:
        """Stop accepting, let the requests in flight finish for at most ``within_s``, end the
        ones still running (a 503, or a stream cut short with an error event), then clean up.

        ``cleanup`` alone is not bounded so: aiohttp waits ``shutdown_timeout`` for a handler,
        then as long again after cancelling its request's body, which a handler streaming its
        answer never reads (two 28 s waits for one long stream)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        for site in list(self.sites):
            await site.stop()
        server = self.server
        if server is not None:
            server.pre_shutdown()  # idle keep-alive connections close now, busy ones after
            # aiohttp signals no "last request ended": poll, as its own shutdown does
            while loop.time() < deadline and not all(_idle(h) for h in server.connections):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            # What still runs is cancelled with a reason, and given a moment to tell its client
            # (a 503, or an error event ending the stream: gateway.errors.STOPPING).
            cut = [h for h in server.connections if not _idle(h) and h._task_handler is not None]
            for handler in cut:
                cast(asyncio.Task[None], handler._task_handler).cancel(STOPPING)
            notice = loop.time() + CUT_NOTICE_S
            while cut and loop.time() < notice and not all(_idle(h) for h in cut):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            for handler in server.connections:
                handler.force_close()
        await self.cleanup()


def make_runner(app: web.Application, **kwargs: Any) -> GuardedRunner:
    """The runner every server of this app uses (``serve``, the tests): bounded connections,
    and the policy's ``server`` limits, which a reload updates in place."""
    from gateway.keys import LIMITS

    limits = app[LIMITS]
    raise_file_limit(2 * limits.max_connections + FD_RESERVE)
    return GuardedRunner(app, limits, **kwargs)
