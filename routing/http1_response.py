"""An answer of the lean HTTP/1.1 client (``routing.http1``) as its reader sees it.

The connection feeds the body's bytes in as they arrive; the reader takes everything buffered
in one read (as aiohttp's ``readany``). ``Content-Encoding: gzip`` and ``deflate`` are decoded
as the body is read, at most ``DECODE_STEP`` bytes of output a read (a small compressed answer
cannot inflate into memory all at once); a compressed body cut short is an error, never a
short answer.
"""

from __future__ import annotations

import asyncio
import collections
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from multidict import CIMultiDictProxy

from routing.http1_errors import BadAnswer, Disconnected

if TYPE_CHECKING:
    from routing.http1_connection import Connection

DECODE_STEP = 64 * 1024  # most decoded bytes one read returns of a compressed body


class Decoder(Protocol):
    """What the body reader uses of a decompressor (zlib's, or ``_Deflate``)."""

    def decompress(self, data: bytes, max_length: int = 0) -> bytes: ...

    def flush(self) -> bytes: ...

    @property
    def unconsumed_tail(self) -> bytes: ...

    @property
    def eof(self) -> bool: ...


def decoder_for(coding: str) -> Decoder | None:
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
        conn: Connection,
        status: int,
        headers: CIMultiDictProxy[str],
        length: int | None,
        decoder: Decoder | None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.content_length = length
        self._conn: Connection | None = conn
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
