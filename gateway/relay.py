"""Send the upstream's answer back to the client.

Streams are relayed byte for byte as they arrive (no SSE parsing, no re-encoding); the relay
only notes when reads arrive (TTFT, inter-token gaps) and whether the stream ended with
``data: [DONE]``. An upstream failure after the first byte becomes a final SSE error event.
A client that goes away cancels the handler (``handler_cancellation``), which closes the
upstream connection, and vLLM then aborts the request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gateway.errors import error_bytes

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
    status: int  # what the request ended as (200, the upstream's 4xx, 502 for a broken stream)
    first_token_at: float | None
    events: int


def response_headers(upstream: aiohttp.ClientResponse, extra: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers.pop("Server", None)
    headers.pop("Date", None)
    headers.update(extra)
    return headers


async def relay_body(
    request: web.Request, upstream: aiohttp.ClientResponse, extra: dict[str, str]
) -> tuple[web.Response, RelayResult]:
    """A non-streaming answer (or an upstream 4xx): read it whole, pass it on unchanged."""
    try:
        body = await upstream.read()
    finally:
        upstream.release()
    resp = web.Response(
        status=upstream.status, body=body, headers=response_headers(upstream, extra)
    )
    return resp, RelayResult(upstream.status, None, 0)


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    extra: dict[str, str],
    started: float,
    ttft: Any,
    itl: Any,
) -> tuple[web.StreamResponse, RelayResult]:
    headers = response_headers(upstream, extra)
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    first_at: float | None = None
    last = 0.0
    events = 0
    tail = b""
    status = upstream.status
    finished = False
    try:
        async for data in upstream.content.iter_any():
            now = time.perf_counter()
            if first_at is None:
                first_at = now
                ttft.observe(now - started)
            else:
                itl.observe(now - last)
            last = now
            events += data.count(b"\n\n")
            await resp.write(data)
            tail = (tail + data)[-32:]
        finished = True
        if _DONE not in tail:
            status = 502
            await _write_error(resp, "the upstream stream ended before [DONE]")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        status = 502
        await _write_error(resp, "the upstream connection broke during the stream")
    except TimeoutError:
        status = 504
        await _write_error(resp, "the upstream stopped sending", "timeout_error", 504)
    except ConnectionResetError:
        # The client went away mid-write; the finally below closes the upstream connection.
        return resp, RelayResult(499, first_at, events)
    finally:
        # Anything but a clean end (an error, the client leaving, a cancelled handler) closes
        # the upstream connection, and vLLM aborts the request and frees its KV cache.
        if finished:
            upstream.release()
        else:
            upstream.close()
    try:
        await resp.write_eof()
    except ConnectionResetError:
        status = 499
    return resp, RelayResult(status, first_at, events)


async def _write_error(
    resp: web.StreamResponse, message: str, type_: str = "upstream_error", code: int = 502
) -> None:
    log.warning("stream ended with an error: %s", message)
    with contextlib.suppress(ConnectionResetError):
        await resp.write(b"data: " + error_bytes(message, type_, code) + b"\n\n")
