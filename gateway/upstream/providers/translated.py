"""An upstream answer in another API's format, read through the interface the relay knows.

``TranslatedResponse`` wraps aiohttp's response. A whole body (an answer or an error) is
translated when it is read; a 200 stream is translated read by read by a ``StreamTranslator``.
Status and headers are the upstream's except the content type (the translated body's) and the
status of a 200 whose body turns out to be no answer: ``read()`` makes it 502 (the relay and the
cascade read the status after the body).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.upstream.client import UpstreamBody, UpstreamStreamError, read_capped

# (upstream status, upstream body) -> (status, OpenAI body)
BodyTranslator = Callable[[int, bytes], tuple[int, bytes]]


class StreamTranslator(Protocol):
    def feed(self, data: bytes) -> bytes:
        """The OpenAI SSE bytes that ``data`` completes (often b"" for a partial event)."""
        ...

    @property
    def error(self) -> UpstreamStreamError | None:
        """The error the upstream's stream reported, once the bytes before it were fed."""
        ...


class TranslatedStream:
    __slots__ = ("_source", "_translator")

    def __init__(self, source: aiohttp.StreamReader, translator: StreamTranslator) -> None:
        self._source = source
        self._translator = translator

    async def readany(self) -> bytes:
        """The next translated bytes; b"" at the end of the upstream's stream. Raises the
        error the stream reported once the bytes it sent before (its usage) were read."""
        while True:
            if self._translator.error is not None:
                raise self._translator.error
            data = await self._source.readany()
            if not data:
                return b""
            out = self._translator.feed(data)
            if out:
                return out

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data


class TranslatedResponse:
    __slots__ = ("_status", "_translate", "_upstream", "content", "headers")

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        translate: BodyTranslator,
        stream: StreamTranslator | None,
    ) -> None:
        """``stream``: the translator of a 200 stream; None for a whole body (or an error)."""
        self._upstream = upstream
        self._translate = translate
        self._status = upstream.status
        headers = CIMultiDict(upstream.headers)
        for name in ("Content-Length", "Set-Cookie"):
            headers.popall(name, None)
        headers["Content-Type"] = "text/event-stream" if stream is not None else "application/json"
        self.headers = CIMultiDictProxy(headers)
        self.content: UpstreamBody = (
            TranslatedStream(upstream.content, stream) if stream is not None else upstream.content
        )

    @property
    def status(self) -> int:
        return self._status

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The translated whole body; ``max_bytes`` bounds the upstream's (``AnswerTooLarge``)."""
        raw = (
            await self._upstream.read()
            if max_bytes is None
            else await read_capped(self._upstream, max_bytes)
        )
        self._status, body = self._translate(self._upstream.status, raw)
        return body

    def release(self) -> None:
        self._upstream.release()

    def close(self) -> None:
        self._upstream.close()
