"""A lean HTTP/1.1 client for replicas served over plain ``http://`` (vLLM's own server).

The gateway sends one shape of request to a self-hosted replica: a POST whose body is already in
memory, on a keep-alive connection, its answer read as it arrives. aiohttp's client does that
with machinery this shape never uses (cookie jar, trace signals, header merging, a task for each
body write, two timers a request): about 170 us of CPU a request on this project's machine,
40 % of what a bare aiohttp proxy spends. This client does the same job in one write and one
parser; ``BackendPool`` uses it for ``kind: vllm`` replicas unless the backend says
``http_client: aiohttp`` (https replicas, health checks, scrapes and other kinds keep aiohttp).

What it guarantees, as aiohttp did for these requests:

* framing and decoding: ``routing.http1_connection`` (the parser) and ``routing.http1_response``
  (the body as its reader takes it, ``gzip`` and ``deflate`` decoded as it is read);
* bounds: the answer's head (``MAX_HEAD`` bytes), a chunk-size line, the bytes buffered ahead
  of the reader (reading pauses past ``HIGH_WATER``), connections per replica (a request waits
  for one while ``max_connections`` are busy; none free by ``first_byte_s`` is
  ``NoFreeConnection``: nothing was sent, so it says nothing of the replica);
* time: ``connect_s`` to connect, ``first_byte_s`` until the answer's head, ``idle_s`` of
  silence while the reader waits for body bytes. Each connection has one timer, re-armed only
  when it fires (a request on a warm connection arms no timer of its own);
* a reused connection that the server closed before any byte of its answer and within
  ``STALE_WINDOW_S`` of the request (its keep-alive ran out as the request left) is resent once,
  on a newly opened connection (never on another idle one: after a restart of the replica every
  idle connection is stale, and each would take a copy); a close later than that is no
  keep-alive race (the server had the request for a while) and is not resent. Every other
  failure is the caller's to handle, with aiohttp's exception types (``routing.http1_errors``)
  so the relay reads both clients alike.

This module is the pool of one replica's connections, and the request it writes.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from routing.http1_connection import Connection
from routing.http1_errors import CannotConnect, ConnectTimeout, NoFreeConnection, Stale
from routing.http1_response import Http1Response

ACCEPT_ENCODING = "gzip, deflate"


class Http1Pool:
    """Keep-alive connections to one replica, at most ``max_connections`` open."""

    def __init__(
        self, host: str, port: int, max_connections: int, keepalive_s: float = 30.0
    ) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: list[Connection] = []
        self._open = 0  # connections open or being opened
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first request
        # The backend pools that send through these connections, each with its limit: a
        # reload's new pool shares the connections of the pool it replaces while that one
        # drains, so the newest limit bounds the replica's connections, old and new together.
        self._holders: list[tuple[object, int]] = []
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host_line = f"Host: {authority}\r\nAccept-Encoding: {ACCEPT_ENCODING}\r\n"

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def open(self) -> bool:
        return not self._closed

    def share(self, max_connections: int) -> object:
        """One more pool sends through these connections; its ``max_connections`` (the newest
        holder's) bounds them all. Returns the token to give back to ``unshare``."""
        token = object()
        self._holders.append((token, max_connections))
        self._limit(max_connections)
        return token

    def unshare(self, token: object) -> None:
        """A pool is done with these connections; the last one closes them."""
        self._holders = [h for h in self._holders if h[0] is not token]
        if self._holders:
            self._limit(self._holders[-1][1])
        else:
            self.close()

    def _limit(self, max_connections: int) -> None:
        self.max_connections = max_connections
        surplus = self._open - max_connections
        while surplus > 0 and self._idle:  # lowered: idle connections past it go
            self._idle.pop(0).abort()
            surplus -= 1
        for waiter in self._waiters:  # raised: waiters may connect now
            if not waiter.done():
                waiter.set_result(None)

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]],
        *,
        connect_s: float,
        first_byte_s: float,
        idle_s: float,
    ) -> Http1Response:
        """POST ``body`` to ``path``; the answer once its head arrived (its body unread)."""
        data = self._request(path, body, headers)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        head_due = loop.time() + first_byte_s
        conn = await self._connection(loop, connect_s, head_due)
        try:
            return await conn.send(data, head_due, idle_s)
        except Stale:
            pass
        # The server's keep-alive ran out as the request left: send it once more, on a new
        # connection (a new one is never stale; another idle one may be stale as well).
        conn = await self._connection(loop, connect_s, head_due, reuse=False)
        return await conn.send(data, head_due, idle_s)

    def _request(self, path: str, body: bytes, headers: Iterable[tuple[str, str]]) -> bytes:
        lines = [f"POST {path} HTTP/1.1\r\n", self._host_line]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} cannot be sent")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        return "".join(lines).encode("utf-8", "surrogateescape") + body

    async def _connection(
        self,
        loop: asyncio.AbstractEventLoop,
        connect_s: float,
        head_due: float,
        reuse: bool = True,
    ) -> Connection:
        """An idle connection (unless ``reuse`` is False), else a new one, else wait for a slot."""
        while True:
            if self._closed:
                raise CannotConnect("the backend is stopping")
            in_use = self._open - len(self._idle)
            while reuse and self._idle and in_use < self.max_connections:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn
            if self._open < self.max_connections:
                return await self._connect(loop, connect_s)
            if not reuse and self._idle and in_use < self.max_connections:
                # The oldest idle one makes room: its connection_lost frees a slot and wakes
                # the first waiter.
                self._idle.pop(0).abort()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(head_due):
                    await waiter
            except TimeoutError:
                raise NoFreeConnection("no connection to the upstream was free in time") from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_s: float) -> Connection:
        self._open += 1
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, loop), self.host, self.port
                )
        except TimeoutError:
            self._closed_one()
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} in time") from None
        except OSError as exc:
            self._closed_one()
            raise CannotConnect(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._closed_one()
            raise
        return conn

    def idle(self, conn: Connection) -> None:
        if self._closed or self._open > self.max_connections:  # closed, or over a lowered limit
            conn.abort()
            return
        self._idle.append(conn)
        self._wake()

    def lost(self, conn: Connection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)
        self._closed_one()

    def _closed_one(self) -> None:
        self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close idle connections now; those in use close when their answers are done."""
        self._closed = True
        for conn in self._idle:
            conn.abort()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
