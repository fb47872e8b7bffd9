"""The client's side of a relayed stream: the upstream's bytes as they came, or re-told.

``StreamOut`` is what the relay writes a stream through. Without a dialect the bytes pass
as they are and the stream is complete once a ``data: [DONE]`` line went by (``data:[DONE]``
too: the space is optional in SSE; the last 32 bytes are kept to see it; the relay made line
ends ``\n``, and inside an event's JSON a newline is escaped, so the model's text cannot fake
the line). With a ``ClientDialect`` (another client API: ``gateway.dialects``) each read
goes through the dialect's encoder, the stream is complete when the encoder saw its end, the
dialect's ``ended`` hook runs before the bytes that end the stream are written (so what it
stores is there before the client can ask for it), and errors and the deadline's stop are
written in the dialect's format.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Protocol

from aiohttp import web

from gateway.errors import error_bytes
from gateway.protocol.sse import DONE, DONE_EVENT

log = logging.getLogger("llm_gateway.relay")

_DONE_LINES = (b"\n" + DONE_EVENT.rstrip(), b"\ndata:" + DONE)


class ClientStream(Protocol):
    """A stream in the client's API, written through as the upstream's bytes arrive."""

    done: bool  # the stream reached its end (a final event, or a failure told)
    failed: bool  # it told of a failure (the upstream's error event, or ``fail``)

    def start(self) -> bytes: ...

    def feed(self, data: bytes) -> bytes: ...

    def fail(self, message: str) -> bytes: ...

    def stop(self) -> bytes: ...


class ClientDialect(Protocol):
    """How an answer goes back to a client of another API than chat completions."""

    def render(self, status: int, body: bytes) -> tuple[int, bytes]:
        """A whole answer (or an upstream error) in the client's format."""
        ...

    def stream(self) -> ClientStream: ...

    async def ended(self) -> None:
        """Called once the answer is complete, before its last bytes are written."""
        ...


# An error event's code, as the JSON answer for the same failure names it (a string, as in
# OpenAI's error objects), when the caller gives none.
_STATUS_CODES = {502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


class StreamOut:
    """The client's side of a stream: the bytes as they came, or re-told by a dialect."""

    __slots__ = ("_client", "_encoder", "_ended", "_resp", "_tail")

    def __init__(self, resp: web.StreamResponse, client: ClientDialect | None) -> None:
        self._resp = resp
        self._client = client
        self._encoder = client.stream() if client is not None else None
        self._tail = b"\n"  # the stream's start counts as after a newline
        self._ended = False

    @property
    def end_name(self) -> str:
        return "[DONE]" if self._encoder is None else "its final event"

    @property
    def complete(self) -> bool:
        """The stream reached its end: ``data: [DONE]``, or the dialect's final event."""
        if self._encoder is None:
            tail = self._tail
            return _DONE_LINES[0] in tail or _DONE_LINES[1] in tail
        return self._encoder.done and not self._encoder.failed

    @property
    def failed(self) -> bool:
        return self._encoder is not None and self._encoder.failed

    async def begin(self) -> None:
        if self._encoder is not None:
            head = self._encoder.start()  # e.g. response.created, before the first token
            if head:
                await self._resp.write(head)

    async def write(self, data: bytes) -> None:
        if self._encoder is None:
            await self._resp.write(data)
            self._tail = (self._tail + data)[-32:]
            return
        told = self._encoder.feed(data)
        await self._end_if_done()
        if told:
            await self._resp.write(told)

    async def error(
        self,
        message: str,
        type_: str = "upstream_error",
        status: int = 502,
        code: str | int | None = None,
    ) -> None:
        log.warning("stream ended with an error: %s", message)
        if self._encoder is not None:
            data = self._encoder.fail(message)
        else:
            code = code if code is not None else _STATUS_CODES.get(status, "bad_gateway")
            data = b"data: " + error_bytes(message, type_, code) + b"\n\n"
        with contextlib.suppress(ConnectionResetError):
            await self._resp.write(data)

    async def stop(self, chat: bool) -> None:
        """End a stream at the deadline the way a model that hit max_tokens would."""
        if self._encoder is None:
            await _write_stop(self._resp, chat)
            return
        data = self._encoder.stop()
        await self._end_if_done()
        with contextlib.suppress(ConnectionResetError):
            await self._resp.write(data)
            await self._resp.write_eof()

    async def _end_if_done(self) -> None:
        encoder, client = self._encoder, self._client
        if client is None or encoder is None or self._ended:
            return
        if encoder.done and not encoder.failed:
            self._ended = True
            await client.ended()


async def _write_stop(resp: web.StreamResponse, chat: bool) -> None:
    """End a stream at the deadline the way a model that hit max_tokens would."""
    if chat:
        choice: dict[str, object] = {"index": 0, "delta": {}, "finish_reason": "length"}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "", "finish_reason": "length"}
        obj = "text_completion"
    chunk = {
        "id": "gateway-deadline",
        "object": obj,
        "created": int(time.time()),
        "choices": [choice],
    }
    with contextlib.suppress(ConnectionResetError):
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n" + DONE_EVENT)
        await resp.write_eof()
