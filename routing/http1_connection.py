"""One keep-alive connection of the lean HTTP/1.1 client: a request written, its answer parsed.

Framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (extensions and trailers read and
dropped) or, without either, until the server closes; 1xx interim answers skipped; no body for
204 and 304; a connection is reused only after an answer read to its end with keep-alive
(HTTP/1.1 without ``Connection: close``) and nothing after it. The parser works on each read
with an offset (no buffer copied per step), bounded by ``MAX_HEAD`` and ``MAX_CHUNK_LINE``;
reading pauses while more than ``HIGH_WATER`` bytes wait for the reader.

Time: each connection has one timer, re-armed only when it fires (a request on a warm
connection arms no timer of its own): ``first_byte_s`` until the answer's head, ``idle_s`` of
silence while the reader waits for body bytes, the pool's keep-alive while it is idle. A reused
connection that the server closed before any byte of its answer and within ``STALE_WINDOW_S``
of the request fails with ``Stale``, for the pool to send the request again.
"""

from __future__ import annotations

import asyncio
import re
import socket
from typing import TYPE_CHECKING, cast

from multidict import CIMultiDict, CIMultiDictProxy

from routing.http1_errors import BadAnswer, Disconnected, HeadTimeout, Silent, Stale
from routing.http1_response import Http1Response, decoder_for

if TYPE_CHECKING:
    from routing.http1 import Http1Pool

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions
HIGH_WATER = 64 * 1024  # bytes buffered ahead of the reader: reading pauses above this
# A reused connection closed this soon after the request, before any byte of the answer, is
# taken for a keep-alive that ran out as the request left (the close crossed it on the wire).
STALE_WINDOW_S = 0.5
# A control byte in a head (but a tab, and CR LF between lines): a bare CR or LF would split a
# header in two on the way to the client (or make aiohttp's server refuse the answer).
_HEAD_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # searched with the CR LFs taken out
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")  # a chunk size: hex digits only (no sign, no "_")

# Parser states of a connection.
_IDLE, _HEAD, _BODY = 0, 1, 2
# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _EMPTY = 0, 1, 2, 3
# Chunked sub-states.
_SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class Connection(asyncio.Protocol):
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
                self._fail_head(Stale())
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
            if not isinstance(exc, Stale):
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
        decoder = (
            decoder_for(headers.get("Content-Encoding", "")) if self.framing != _EMPTY else None
        )
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
