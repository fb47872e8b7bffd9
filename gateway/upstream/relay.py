"""Send the upstream's answer back to the client.

Streams are relayed byte for byte as they arrive (no SSE parsing, no re-encoding); the relay
only notes when reads arrive (TTFT, gaps between reads) and whether the stream ended with
``data: [DONE]``. An upstream failure after the first byte becomes a final SSE error event.
Past the surface's deadline the relay stops the upstream and ends the stream itself with a
chunk whose ``finish_reason`` is ``length``. A client that goes away cancels the handler
(``handler_cancellation``); the ``finally`` below then closes the upstream connection, and
vLLM aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.errors import error_bytes
from gateway.upstream.client import UpstreamResponse, UpstreamStreamError

log = logging.getLogger("llm_gateway.relay")

_DONE = b"data: [DONE]"
_HOP_BY_HOP = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
}


@dataclass(slots=True)
class RelayResult:
    status: int  # 200, the upstream's 4xx, 502/504 for a broken stream, 499 client gone
    body: bytes | None = None  # the whole answer of a non-streaming request
    first_at: float | None = None  # perf_counter of the first streamed bytes
    last_at: float | None = None
    reads: int = 0
    deadline_hit: bool = False

    def mean_gap_ms(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.reads < 2:
            return None
        return (self.last_at - self.first_at) * 1000 / (self.reads - 1)


def response_headers(upstream: UpstreamResponse, extra: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers.pop("Server", None)
    headers.pop("Date", None)
    headers.update(extra)
    return headers


async def relay_body(
    upstream: UpstreamResponse, extra: dict[str, str]
) -> tuple[web.Response, RelayResult]:
    """A non-streaming answer (or an upstream 4xx): read it whole, pass it on unchanged."""
    try:
        body = await upstream.read()
    finally:
        upstream.release()
    resp = web.Response(
        status=upstream.status, body=body, headers=response_headers(upstream, extra)
    )
    return resp, RelayResult(upstream.status, body=body)


@dataclass(slots=True)
class StreamPlan:
    """How to relay one stream: bytes already read, the deadline, and who watches the reads."""

    first: bytes = b""
    first_at: float | None = None
    deadline: float | None = None  # perf_counter past which the gateway ends the stream
    chat: bool = True
    on_read: Callable[[bytes], None] | None = None  # e.g. the span's stream summarizer
    on_gap: Callable[[float], None] | None = None  # seconds between consecutive reads


async def relay_stream(
    request: web.Request, upstream: UpstreamResponse, extra: dict[str, str], plan: StreamPlan
) -> tuple[web.StreamResponse, RelayResult]:
    headers = response_headers(upstream, extra)
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    result = RelayResult(upstream.status)
    tail = b""
    finished = False

    async def write(data: bytes, at: float) -> None:
        nonlocal tail
        if result.first_at is None:
            result.first_at = at
        elif plan.on_gap is not None and result.last_at is not None:
            plan.on_gap(at - result.last_at)
        result.last_at = at
        result.reads += 1
        if plan.on_read is not None:
            plan.on_read(data)
        await resp.write(data)
        tail = (tail + data)[-32:]

    try:
        if plan.first:
            await write(plan.first, plan.first_at or time.perf_counter())
        remaining = None if plan.deadline is None else plan.deadline - time.perf_counter()
        try:
            async with asyncio.timeout(remaining):
                async for data in upstream.content.iter_any():
                    await write(data, time.perf_counter())
        except TimeoutError:
            if plan.deadline is None or time.perf_counter() < plan.deadline:
                raise  # the upstream went silent (idle_s), not our deadline
            result.deadline_hit = True
            await _write_stop(resp, plan.chat)
            return resp, result
        finished = True
        if _DONE not in tail:
            result.status = 502
            await _write_error(resp, "the upstream stream ended before [DONE]")
    except UpstreamStreamError as exc:  # the upstream said why (e.g. Anthropic's error event)
        result.status = 502
        await _write_error(resp, str(exc))
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        result.status = 502
        await _write_error(resp, "the upstream connection broke during the stream")
    except TimeoutError:
        result.status = 504
        await _write_error(resp, "the upstream stopped sending", "timeout_error", 504)
    except ConnectionResetError:
        result.status = 499  # the client went away mid-write
        return resp, result
    except asyncio.CancelledError:
        if _DONE not in tail:
            raise  # the client went away before the end (or the server is stopping)
        # Every byte up to [DONE] was handed over and the client closed, as clients may, while
        # the upstream's end of body was awaited: a complete answer, so the cancel is absorbed.
        if (task := asyncio.current_task()) is not None:
            task.uncancel()
        return resp, result
    finally:
        # Anything but a clean end (an error, the deadline, the client leaving, a cancelled
        # handler) closes the upstream connection, so the replica aborts the request.
        if finished:
            upstream.release()
        else:
            upstream.close()
    try:
        await resp.write_eof()
    except ConnectionResetError:
        if _DONE not in tail:  # a client that read [DONE] may close before the end of body
            result.status = 499
    return resp, result


async def _write_error(
    resp: web.StreamResponse, message: str, type_: str = "upstream_error", code: int = 502
) -> None:
    log.warning("stream ended with an error: %s", message)
    with contextlib.suppress(ConnectionResetError):
        await resp.write(b"data: " + error_bytes(message, type_, code) + b"\n\n")


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
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n" + _DONE + b"\n\n")
        await resp.write_eof()
