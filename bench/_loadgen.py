"""A lean HTTP/1.1 load generator for bench.overhead.

It speaks just enough HTTP/1.1 over keep-alive asyncio connections (Content-Length or chunked
bodies) to time requests with little client-side cost: on a core shared with the upstream, an
aiohttp client would be the bottleneck long before a proxy on the other core is. Latencies are
measured client-side with perf_counter, from the moment a request is handed to a connection
(a new connection's set-up included). For streamed (SSE) responses it records when the first
and the last event (a "\\n\\n" boundary in the de-chunked body) arrived.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's timings in seconds from its start."""

    ok: bool
    first_event: float  # first SSE event, or the whole response when not streamed
    done: float
    events: int
    gaps: tuple[float, ...] = ()  # between reads that brought SSE events


MAX_CONNECTIONS = 4096  # per target; a request past it counts as failed


@dataclass(slots=True)
class _Pending:
    started: float
    future: asyncio.Future[Sample]
    first_event: float = 0.0
    last_event: float = 0.0
    events: int = 0
    gaps: list[float] = field(default_factory=list)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    def __init__(self, on_idle: Callable[[_Connection], None]) -> None:
        self._on_idle = on_idle
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._pending: _Pending | None = None
        self._status = 0
        self._in_headers = True
        self._chunked = False
        self._remaining = 0  # Content-Length body bytes, or bytes left in the current chunk
        self._chunk_trailer = False  # inside the CRLF after a chunk's data
        self._tail = b""  # last byte of body data, so a "\n\n" split over reads still counts
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail()

    def send(self, raw: bytes, started: float) -> asyncio.Future[Sample]:
        assert self._transport is not None
        assert self._pending is None
        future: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
        self._pending = _Pending(started, future)
        self._in_headers = True
        self._buf.clear()
        self._tail = b""
        self._transport.write(raw)
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.future.done():
            now = time.perf_counter() - pending.started
            pending.future.set_result(Sample(False, now, now, pending.events))

    def data_received(self, data: bytes) -> None:
        if self._pending is None:
            return
        self._buf += data
        if self._in_headers and not self._parse_headers():
            return
        self._parse_body()

    def _parse_headers(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        self._status = int(head[0].split(" ", 2)[1])
        self._chunked = False
        self._remaining = 0
        self._chunk_trailer = False
        for line in head[1:]:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            if key == "content-length":
                self._remaining = int(value)
            elif key == "transfer-encoding" and "chunked" in value.lower():
                self._chunked = True
        self._in_headers = False
        return True

    def _body(self, data: bytes | bytearray) -> None:
        pending = self._pending
        assert pending is not None
        joined = self._tail + data
        count = joined.count(b"\n\n")
        if count:
            now = time.perf_counter() - pending.started
            if pending.events == 0:
                pending.first_event = now
            else:
                pending.gaps.append(now - pending.last_event)
            pending.last_event = now
            pending.events += count
        self._tail = bytes(data[-1:])

    def _parse_body(self) -> None:
        buf = self._buf
        if not self._chunked:
            take = min(self._remaining, len(buf))
            if take:
                self._body(buf[:take])
                del buf[:take]
                self._remaining -= take
            if self._remaining == 0:
                self._finish()
            return
        while True:
            if self._remaining:
                take = min(self._remaining, len(buf))
                if not take:
                    return
                self._body(buf[:take])
                del buf[:take]
                self._remaining -= take
                if self._remaining:
                    return
                self._chunk_trailer = True
            if self._chunk_trailer:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._chunk_trailer = False
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                return
            size = int(bytes(buf[:line_end]).split(b";")[0], 16)
            del buf[: line_end + 2]
            if size == 0:
                # Last chunk; no trailers are sent by the servers under test.
                if len(buf) >= 2:
                    del buf[:2]
                self._finish()
                return
            self._remaining = size

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        done = time.perf_counter() - pending.started
        first = pending.first_event if pending.events else done
        ok = self._status == 200
        if not pending.future.done():  # a cancelled waiter (a run stopped) wants no result
            pending.future.set_result(Sample(ok, first, done, pending.events, tuple(pending.gaps)))
        self._on_idle(self)


@dataclass(slots=True)
class Target:
    """Where requests go: host, port, and the bytes of one complete request."""

    host: str
    port: int
    raw_request: bytes
    _idle: list[_Connection] = field(default_factory=list)
    _all: list[_Connection] = field(default_factory=list)

    @staticmethod
    def build(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> Target:
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        return Target(host, port, raw)

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        if len(self._all) >= MAX_CONNECTIONS:
            self._all = [c for c in self._all if not c.closed]
            if len(self._all) >= MAX_CONNECTIONS:
                # A level this far behind has failed any latency bound already; opening more
                # sockets would only exhaust this process's file descriptors.
                raise OSError(f"{MAX_CONNECTIONS} requests in flight to one target")
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(self._idle.append), self.host, self.port
        )
        self._all.append(conn)
        return conn

    async def one(self, started: float) -> Sample:
        try:
            conn = await self._connection()
        except OSError:
            now = time.perf_counter() - started
            return Sample(False, now, now, 0)
        return await conn.send(self.raw_request, started)

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()
