"""A lean HTTP/1.1 client for replicas served over plain ``http://`` (vLLM's own server).

The gateway sends one shape of request to a self-hosted replica: a POST whose body is already in
memory, on a keep-alive connection, its answer read as it arrives. aiohttp's client does that
with machinery this shape never uses (cookie jar, trace signals, header merging, a task for each
body write, two timers a request): about 170 us of CPU a request on this project's machine,
40 % of what a bare aiohttp proxy spends. This client does the same job in one write and one
parser; ``BackendPool`` uses it for ``kind: vllm`` replicas unless the backend says
``http_client: aiohttp`` (https replicas, health checks, scrapes and other kinds keep aiohttp).

What it guarantees, as aiohttp did for these requests:

* framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (extensions and trailers read and
  dropped) or, without either, until the server closes; 1xx interim answers skipped; no body
  for 204 and 304; a connection is reused only after an answer read to its end with
  keep-alive (HTTP/1.1 without ``Connection: close``) and nothing after it;
* ``Content-Encoding: gzip`` and ``deflate`` decoded as the body is read, at most
  ``DECODE_STEP`` bytes of output a read (a small compressed answer cannot inflate into memory
  all at once); a compressed body cut short is an error, never a short answer;
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
  failure is the caller's to handle, with aiohttp's exception types (``ServerDisconnectedError``, ``ServerTimeoutError``,
  ``ClientPayloadError``, ``ClientConnectionError``) so the relay reads both clients alike.
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import zlib
from collections.abc import AsyncIterator, Iterable
from typing import Protocol, cast

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions
HIGH_WATER = 64 * 1024  # bytes buffered ahead of the reader: reading pauses above this
DECODE_STEP = 64 * 1024  # most decoded bytes one read returns of a compressed body
ACCEPT_ENCODING = "gzip, deflate"
# A reused connection closed this soon after the request, before any byte of the answer, is
# taken for a keep-alive that ran out as the request left (the close crossed it on the wire).
STALE_WINDOW_S = 0.5
# A control byte in a head (but a tab, and CR LF between lines): a bare CR or LF would split a
# header in two on the way to the client (or make aiohttp's server refuse the answer).
_HEAD_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # searched with the CR LFs taken out
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")  # a chunk size: hex digits only (no sign, no "_")


class CannotConnect(aiohttp.ClientConnectionError):
    """No connection to the replica (refused, unreachable, or not within ``connect_s``)."""


class ConnectTimeout(aiohttp.ConnectionTimeoutError):
    """The connection was not made within ``connect_s``."""


class Disconnected(aiohttp.ServerDisconnectedError):
    """The server closed the connection before the end of its answer."""


class HeadTimeout(aiohttp.ServerTimeoutError):
    """No answer head within ``first_byte_s``."""


class NoFreeConnection(aiohttp.ServerTimeoutError):
    """Every connection to the replica stayed busy until ``first_byte_s``: nothing was sent."""


class Silent(aiohttp.ServerTimeoutError):
    """No body byte for ``idle_s`` while the reader waited."""


class BadAnswer(aiohttp.ClientPayloadError):
    """An answer that breaks HTTP/1.1 framing, or a body that does not decode."""


class _Stale(Exception):
    """A reused connection closed before any byte of the answer, just after the request was
    sent: its keep-alive had run out, the request was not read; safe to send again, once."""


# Parser states of a connection.
_IDLE, _HEAD, _BODY = 0, 1, 2
# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _EMPTY = 0, 1, 2, 3
# Chunked sub-states.
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class _Decoder(Protocol):
    """What the body reader uses of a decompressor (zlib's, or ``_Deflate``)."""

    def decompress(self, data: bytes, max_length: int = 0) -> bytes: ...

    def flush(self) -> bytes: ...

    @property
    def unconsumed_tail(self) -> bytes: ...

    @property
    def eof(self) -> bool: ...


def _decoder(coding: str) -> _Decoder | None:
    coding = coding.strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == "deflate":
        return _Deflate()  # zlib-wrapped or raw, told by the data
    raise BadAnswer(f"unsupported Content-Encoding: {coding!r}")


class _Deflate:
    """``deflate`` as servers send it: zlib-wrapped (RFC 9110) or raw (some servers)."""

    def __init__(self) -> None:
        self._inner: zlib._Decompress | None = None

    def _pick(self, data: bytes) -> zlib._Decompress:
        if self._inner is None:
            wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._inner = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        return self._inner

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        return self._pick(data).decompress(data, max_length)

    @property
    def unconsumed_tail(self) -> bytes:
        return b"" if self._inner is None else self._inner.unconsumed_tail

    @property
    def eof(self) -> bool:
        return self._inner is not None and self._inner.eof

    def flush(self) -> bytes:
        return b"" if self._inner is None else self._inner.flush()


class Http1Response:
    """An answer whose head arrived; its body is read with ``readany``/``iter_any``/``read``.

    Shaped like aiohttp's ``ClientResponse`` where the gateway reads one (``status``,
    ``headers``, ``content``, ``content_length``, ``release``, ``close``).
    """

    __slots__ = (
        "_chunks",
        "_conn",
        "_decoder",
        "_eof",
        "_exc",
        "_released",
        "_size",
        "_waiter",
        "content_length",
        "headers",
        "status",
    )

    def __init__(
        self,
        conn: _Conn,
        status: int,
        headers: CIMultiDictProxy[str],
        length: int | None,
        decoder: _Decoder | None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.content_length = length
        self._conn: _Conn | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decoder = decoder
        self._released = False

    @property
    def content(self) -> Http1Response:
        return self

    # --- fed by the connection ------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            if not waiter.done():
                waiter.set_result(None)

    def _end(self, exc: BaseException | None = None) -> None:
        if self._eof:
            return
        self._eof = True
        if exc is not None:
            self._exc = exc
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            if not waiter.done():
                waiter.set_result(None)

    # --- read by the relay -------------------------------------------------------------------

    async def readany(self) -> bytes:
        """The next bytes of the body as they arrived (decoded); ``b""`` at its end."""
        while True:
            chunks = self._chunks
            if chunks:
                # Everything buffered, as one read (as aiohttp's readany): a burst of stream
                # events is relayed in one write and counts as one read, not gaps of zero.
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                if self._decoder is None:
                    return data
                out = self._decode(data)
                if out:
                    return out
                continue
            if self._exc is not None:
                raise self._exc
            if self._eof:
                if self._decoder is not None:
                    rest = self._finish_decoding()
                    if rest:
                        return rest
                return b""
            conn = self._conn
            if conn is None:  # closed by its owner
                raise Disconnected("the answer was closed")
            self._waiter = conn.loop.create_future()
            conn.watch_idle()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _decode(self, data: bytes) -> bytes:
        decoder = self._decoder
        assert decoder is not None
        try:
            out = decoder.decompress(data, DECODE_STEP)
        except zlib.error as exc:
            self._fail_decoding()
            raise BadAnswer(f"the answer's body does not decode: {exc}") from exc
        tail = decoder.unconsumed_tail
        if tail:  # more output is due from this input: the next read takes it first
            self._chunks.appendleft(tail)
            self._size += len(tail)
        return out

    def _finish_decoding(self) -> bytes:
        decoder = self._decoder
        assert decoder is not None
        if not decoder.eof:
            self._fail_decoding()
            raise BadAnswer("the answer's compressed body ended before its end")
        self._decoder = None
        return decoder.flush()

    def _fail_decoding(self) -> None:
        self._decoder = None
        self._chunks.clear()
        self.close()

    def whole(self, limit: int) -> bytes | None:
        """The whole body, if it already arrived (undecoded, at most ``limit`` bytes); else None
        (read it with ``readany``). A small answer usually arrives with its head."""
        if not self._eof or self._exc is not None or self._decoder is not None:
            return None
        if self._size > limit:
            return None
        chunks = self._chunks
        data = b"".join(chunks) if len(chunks) != 1 else chunks[0]
        chunks.clear()
        self._size = 0
        return data

    def iter_any(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read
        to its end and the server keeps it alive; otherwise it is closed."""
        if self._released:
            return
        self._released = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release(self._eof and not self._chunks and self._exc is None)

    def close(self) -> None:
        """Close the connection now (the replica sees the request go and aborts it)."""
        self._released = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release(False)
        if not self._eof:
            self._end(Disconnected("the answer was closed"))


class _Chunks:
    __slots__ = ("_response",)

    def __init__(self, response: Http1Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        data = await self._response.readany()
        if not data:
            raise StopAsyncIteration
        return data


class _Conn(asyncio.Protocol):
    """One keep-alive connection: writes a request, parses the answer into an Http1Response."""

    def __init__(self, pool: Http1Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.reused = False
        self.state = _IDLE
        self.buf = b""  # the start of an incomplete head or line, kept for the next read
        self.head_waiter: asyncio.Future[Http1Response] | None = None
        self.response: Http1Response | None = None
        self.framing = _EMPTY
        self.remaining = 0  # body bytes left (_LENGTH) or of the current chunk (_CHUNKED)
        self.chunk_state = _SIZE
        self.keep_alive = True
        self.got_bytes = False
        self.sent_at = 0.0
        self.idle_s = 0.0
        self.head_due = 0.0
        self.last_data = 0.0
        self.wait_since = 0.0  # when the reader began waiting for body bytes
        self.idle_since = loop.time()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self.loop.time()
        if self.state == _BODY and self.framing == _LENGTH and not self.buf:
            # The common case: body bytes of a sized answer, passed on without a copy.
            size = len(data)
            if size <= self.remaining:
                self.remaining -= size
                assert self.response is not None
                self.response._feed(data)
                if self.remaining == 0:
                    self._answered()
                self._flow()
                return
        if self.buf:
            data = self.buf + data
            self.buf = b""
        try:
            self.buf = self._parse(data)
        except BadAnswer as exc:
            self._fail(exc)
            return
        except Exception as exc:  # a parser bug must fail this answer, never leave it waiting
            self._fail(BadAnswer(f"the answer could not be parsed: {type(exc).__name__}"))
            return
        self._flow()

    def eof_received(self) -> bool | None:
        self.closed = True  # the server is done with this connection: it is never reused
        return None  # the transport closes; connection_lost ends what is in flight

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self.pool.lost(self)
        if self.state == _HEAD:
            if (
                self.reused
                and not self.got_bytes
                and self.loop.time() - self.sent_at < STALE_WINDOW_S
            ):
                self._fail_head(_Stale())
            else:
                self._fail_head(Disconnected("the upstream closed the connection before answering"))
        elif self.state == _BODY and self.response is not None:
            if self.framing == _UNTIL_CLOSE and not self.buf:
                self.response._end()
            else:
                self.response._end(Disconnected("the upstream closed the connection mid-answer"))
        self.state = _IDLE

    # --- a request ------------------------------------------------------------------------

    async def send(self, data: bytes, head_due: float, idle_s: float) -> Http1Response:
        assert self.transport is not None
        self.state = _HEAD
        self.got_bytes = False
        self.idle_s = idle_s
        self.head_due = head_due
        self.response = None
        waiter: asyncio.Future[Http1Response] = self.loop.create_future()
        self.head_waiter = waiter
        self._arm(head_due)
        self.sent_at = self.loop.time()
        self.transport.write(data)
        try:
            return await waiter
        except BaseException as exc:
            if not isinstance(exc, _Stale):
                self.abort()  # cancelled or failed: the replica must see the request go
            raise
        finally:
            self.head_waiter = None

    def release(self, reusable: bool) -> None:
        """The response's owner is done with it."""
        if self.closed:
            return
        if reusable and self.keep_alive and self.state == _IDLE and not self.buf:
            self.response = None
            self.reused = True
            self.idle_since = self.loop.time()
            self._arm(self.idle_since + self.pool.keepalive_s)
            self.pool.idle(self)
        else:
            self.abort()

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()  # connection_lost follows and tells the pool

    def watch_idle(self) -> None:
        """The reader waits for body bytes: ``idle_s`` without one from now on fails it."""
        self.wait_since = self.loop.time()
        self._arm(max(self.last_data, self.wait_since) + self.idle_s)

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # --- parsing ------------------------------------------------------------------------------

    def _parse(self, data: bytes) -> bytes:
        """Parse what arrived; returns the bytes of an incomplete line or head, kept for the
        next read. Works on ``data`` with an offset: no buffer is copied per step."""
        pos, size = 0, len(data)
        while pos < size:
            if self.state == _HEAD:
                pos = self._parse_head(data, pos)
            elif self.state == _BODY:
                pos = self._parse_body(data, pos)
            else:  # bytes after the answer, or unasked for: this connection is done
                self.keep_alive = False
                self.abort()
                return b""
            if pos < 0:
                return data[-pos - 1 :]
        return b""

    def _parse_head(self, data: bytes, pos: int) -> int:
        """Past the head; or ``-pos - 1`` while it is incomplete."""
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            if len(data) - pos > MAX_HEAD:
                raise BadAnswer("the answer's head is too large")
            return -pos - 1
        if end - pos > MAX_HEAD:
            raise BadAnswer("the answer's head is too large")
        head = data[pos:end]
        if _HEAD_CTL.search(head.replace(b"\r\n", b"")) is not None:
            raise BadAnswer("the answer's head holds a control character")
        lines = head.decode("latin-1").split("\r\n")  # one decode for the whole head
        status_line = lines[0]
        if not status_line.startswith("HTTP/1.") or len(status_line) < 12:
            raise BadAnswer("not an HTTP/1.x answer")
        code = status_line[9:12]
        if not (code.isascii() and code.isdigit()) or status_line[12:13] not in ("", " "):
            raise BadAnswer("the answer's status line does not parse")
        status = int(code)
        if status < 100:
            raise BadAnswer("the answer's status line does not parse")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[0] in " \t" or name[-1] in " \t":
                raise BadAnswer("a header line of the answer does not parse")
            headers.add(name, value.strip(" \t"))
        if 100 <= status < 200:
            if status == 101:
                raise BadAnswer("the upstream switched protocols")
            return (
                end + 4
            )  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self._start_body(status_line, status, headers)
        return end + 4

    def _start_body(self, status_line: str, status: int, headers: CIMultiDict[str]) -> None:
        connection = headers.get("Connection", "").lower()
        if status_line.startswith("HTTP/1.0"):
            self.keep_alive = "keep-alive" in connection
        else:
            self.keep_alive = "close" not in connection
        length: int | None = None
        coding = headers.get("Transfer-Encoding")
        if status in (204, 304):
            self.framing = _EMPTY
        elif coding is not None:
            if coding.rsplit(",", 1)[-1].strip().lower() == "chunked":
                self.framing = _CHUNKED
                self.chunk_state = _SIZE
                if "Content-Length" in headers:  # both: chunked wins, the connection ends
                    self.keep_alive = False
            else:
                self.framing = _UNTIL_CLOSE
                self.keep_alive = False
        elif "Content-Length" in headers:
            values = {v.strip() for v in headers.getall("Content-Length")}
            value = values.pop()
            if values or not (value.isascii() and value.isdigit()):
                raise BadAnswer("the answer's Content-Length is not one number")
            length = int(value)
            self.framing = _LENGTH if length else _EMPTY
            self.remaining = length
        else:
            self.framing = _UNTIL_CLOSE
            self.keep_alive = False
        decoder = _decoder(headers.get("Content-Encoding", "")) if self.framing != _EMPTY else None
        response = Http1Response(self, status, CIMultiDictProxy(headers), length, decoder)
        self.response = response
        self.state = _BODY
        if self.framing == _EMPTY:
            self._answered()
        waiter = self.head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _parse_body(self, data: bytes, pos: int) -> int:
        """Past what was used of ``data``; or ``-pos - 1`` when a line is incomplete."""
        response = self.response
        assert response is not None
        size = len(data)
        framing = self.framing
        if framing == _UNTIL_CLOSE:
            response._feed(data[pos:] if pos else data)
            return size
        if framing == _LENGTH or self.chunk_state == _DATA:
            take = min(self.remaining, size - pos)
            response._feed(data if take == size else data[pos : pos + take])
            self.remaining -= take
            if self.remaining == 0:
                if framing == _LENGTH:
                    self._answered()
                else:
                    self.chunk_state = _DATA_END
            return pos + take
        state = self.chunk_state
        if state == _DATA_END:
            if size - pos < 2:
                return -pos - 1
            if data[pos : pos + 2] != b"\r\n":
                raise BadAnswer("a chunk of the answer is longer than its size")
            self.chunk_state = _SIZE
            return pos + 2
        end = data.find(b"\r\n", pos)
        if state == _SIZE:
            if end < 0:
                if size - pos > MAX_CHUNK_LINE:
                    raise BadAnswer("a chunk-size line of the answer is too long")
                return -pos - 1
            size_text = data[pos:end].split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size_text) is None:
                raise BadAnswer("a chunk size of the answer does not parse")
            length = int(size_text, 16)
            start = end + 2
            stop = start + length
            if length and data[stop : stop + 2] == b"\r\n":  # the whole chunk is here
                response._feed(data[start:stop])
                return stop + 2
            self.remaining = length
            self.chunk_state = _DATA if length else _TRAILER
            return start
        # trailers: lines until an empty one
        if end < 0:
            if size - pos > MAX_HEAD:
                raise BadAnswer("the answer's trailers are too large")
            return -pos - 1
        if end == pos:
            self._answered()
        return end + 2

    def _answered(self) -> None:
        """The answer's last byte arrived."""
        self.state = _IDLE
        assert self.response is not None
        self.response._end()

    def _flow(self) -> None:
        response = self.response
        if (
            self.state == _BODY
            and response is not None
            and not self.paused
            and response._size > HIGH_WATER
            and self.transport is not None
            and not self.closed
        ):
            self.paused = True
            self.transport.pause_reading()

    def _fail(self, exc: BaseException) -> None:
        if self.state == _HEAD:
            self._fail_head(exc)
        elif self.response is not None:
            self.response._end(exc)
        self.state = _IDLE
        self.abort()

    def _fail_head(self, exc: BaseException) -> None:
        waiter = self.head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    # --- the one timer -----------------------------------------------------------------------

    def _arm(self, at: float) -> None:
        if self.timer is not None:
            if self.timer_at <= at:
                return  # fires first; then it arms again for what is due
            self.timer.cancel()
        self.timer = self.loop.call_at(at, self._fire)
        self.timer_at = at

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self) -> None:
        self.timer = None
        if self.closed:
            return
        now = self.loop.time()
        if self.state == _HEAD:
            if now >= self.head_due:
                self._fail(HeadTimeout("the upstream sent no answer in time"))
            else:
                self._arm(self.head_due)
        elif self.state == _BODY:
            response = self.response
            if response is not None and response._waiter is not None:
                due = max(self.last_data, self.wait_since) + self.idle_s
                if now >= due:
                    self._fail(Silent("the upstream stopped sending"))
                else:
                    self._arm(due)
        elif self.response is None:  # in the pool
            due = self.idle_since + self.pool.keepalive_s
            if now >= due:
                self.abort()
            else:
                self._arm(due)


class Http1Pool:
    """Keep-alive connections to one replica, at most ``max_connections`` open."""

    def __init__(
        self, host: str, port: int, max_connections: int, keepalive_s: float = 30.0
    ) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: list[_Conn] = []
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
        except _Stale:
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
    ) -> _Conn:
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

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_s: float) -> _Conn:
        self._open += 1
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self, loop), self.host, self.port
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

    def idle(self, conn: _Conn) -> None:
        if self._closed or self._open > self.max_connections:  # closed, or over a lowered limit
            conn.abort()
            return
        self._idle.append(conn)
        self._wake()

    def lost(self, conn: _Conn) -> None:
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
