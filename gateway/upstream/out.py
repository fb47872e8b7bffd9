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

A stream that ends in an error is logged at WARNING once per replica and error code every
10 s (``LogEvery``): a replica that breaks every stream would otherwise write a line per
request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Protocol

from aiohttp import web

from gateway.errors import GatewayError, error_bytes
from gateway.observability.log_every import LogEvery
from gateway.protocol.sse import DONE, DONE_EVENT

log = logging.getLogger("llm_gateway.relay")
_stream_errors = LogEvery(log)  # keyed by (backend/replica, error code)

_DONE_LINES = (b"\n" + DONE_EVENT.rstrip(), b"\ndata:" + DONE)
_HEAD_BYTES = 2048  # kept of a stream's first bytes: its first chunk, for the deadline's stop


class ClientStream(Protocol):
    """A stream in the client's API, written through as the upstream's bytes arrive."""

    done: bool  # the stream reached its end (a final event, or a failure told)
    failed: bool  # it told of a failure (the upstream's error event, or ``fail``)

    def start(self) -> bytes: ...

    def feed(self, data: bytes) -> bytes: ...

    def fail(self, error: GatewayError) -> bytes:
        """The gateway's own failure, told as the client's API tells that error unstreamed."""
        ...

    def stop(self, estimate: dict[str, Any] | None = None) -> bytes:
        """The deadline's end; ``estimate``: chat's usage object the gateway charges."""
        ...


class ClientDialect(Protocol):
    """How an answer goes back to a client of another API than chat completions."""

    def render(self, status: int, body: bytes) -> tuple[int, bytes]:
        """A whole answer (or an upstream error) in the client's format."""
        ...

    def stream(self) -> ClientStream: ...

    async def ended(self) -> None:
        """Called once the answer is complete, before its last bytes are written."""
        ...


class StreamOut:
    """The client's side of a stream: the bytes as they came, or re-told by a dialect."""

    __slots__ = ("_client", "_encoder", "_ended", "_head", "_resp", "_tail", "_where")

    def __init__(self, resp: web.StreamResponse, client: ClientDialect | None, where: str) -> None:
        self._resp = resp
        self._where = where  # backend/replica the stream comes from, for the log
        self._client = client
        self._encoder = client.stream() if client is not None else None
        self._tail = b"\n"  # the stream's start counts as after a newline
        self._head = b""  # the first bytes as they came: the stream's id and model
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
            if len(self._head) < _HEAD_BYTES:
                self._head += data[:_HEAD_BYTES]
            return
        told = self._encoder.feed(data)
        await self._end_if_done()
        if told:
            await self._resp.write(told)

    async def error(self, error: GatewayError) -> None:
        """End the stream with ``error``: its type and code (the dialect's, for another API)
        as the JSON answer for the same failure would say them."""
        _stream_errors.warning(
            (self._where, error.named_code()),
            "stream from %s ended with an error: %s",
            self._where,
            error.message,
        )
        if self._encoder is not None:
            data = self._encoder.fail(error)
        else:
            data = b"data: " + error_bytes(error.message, error.type, error.named_code()) + b"\n\n"
        with contextlib.suppress(ConnectionResetError):
            await self._resp.write(data)

    async def stop(self, chat: bool, estimate: dict[str, Any] | None = None) -> None:
        """End a stream at the deadline the way a model that hit max_tokens would: the
        stream's own id and model, and the usage the gateway charges (``estimate``, chat's usage
        object) where the client asked for usage (None: it did not)."""
        if self._encoder is None:
            await _write_stop(self._resp, chat, _first_chunk(self._head), estimate)
            return
        data = self._encoder.stop(estimate)
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


def _first_chunk(head: bytes) -> dict[str, Any]:
    """The stream's first chunk (its id, created time and model), if it is whole in ``head``."""
    start = head.find(b"data:")
    end = head.find(b"\n", start)
    if start < 0 or end < 0:
        return {}
    try:
        chunk = json.loads(head[start + 5 : end])
    except ValueError:
        return {}
    return chunk if isinstance(chunk, dict) else {}


async def _write_stop(
    resp: web.StreamResponse,
    chat: bool,
    first: dict[str, Any],
    estimate: dict[str, Any] | None,
) -> None:
    """End a stream at the deadline the way a model that hit max_tokens would."""
    if chat:
        choice: dict[str, object] = {"index": 0, "delta": {}, "finish_reason": "length"}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "", "finish_reason": "length"}
        obj = "text_completion"
    head: dict[str, Any] = {
        "id": first.get("id") if isinstance(first.get("id"), str) else "gateway-deadline",
        "object": obj,
        "created": first.get("created") if isinstance(first.get("created"), int) else 0,
        "model": first.get("model") if isinstance(first.get("model"), str) else "",
    }
    if not head["created"]:
        head["created"] = int(time.time())
    chunks = [{**head, "choices": [choice]}]
    if estimate is not None:
        chunks.append({**head, "choices": [], "usage": estimate})
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    with contextlib.suppress(ConnectionResetError):
        await resp.write(data + DONE_EVENT)
        await resp.write_eof()
