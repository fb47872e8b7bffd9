"""Read a request body under the gateway's bounds: size on the wire, time, and decoded size.

aiohttp would inflate a gzip or deflate body on its own, with no bound on what it inflates to
(61 KB on the wire became 60 MiB), so the server runs with ``auto_decompress=False`` and the
body is decoded here:

- the bytes on the wire may not exceed ``max_body_bytes`` (413, read stops there);
- the whole body must arrive within ``body_timeout_s`` (408, the connection is closed);
- ``Content-Encoding`` may be ``identity``, ``gzip``, ``x-gzip`` or ``deflate`` (zlib, or raw
  deflate as some clients send it), one layer; anything else is a 415 naming what is accepted;
- the decoded body may not exceed ``max_body_bytes`` either, nor ``max_inflate_ratio`` times
  its size on the wire (past the first MiB): a bomb is refused after inflating at most that
  much (413). Real JSON compresses 3-20x; a bomb of one repeated byte, about 1,000x;
- undecodable compressed data (bad header, truncated, trailing garbage) is a 400.

Inflating runs in a worker thread (zlib releases the GIL), so a large body does not stall the
event loop (measured: inline inflating under a closed-loop bomb attack doubled the p50 of
other clients), one body at a time; plain bodies, the common case, never leave the loop. (The
gzip trailer's stated size is not trusted to refuse early: a cut or padded body would then get
a misleading 413, and a bomb can forge it anyway.)
"""

from __future__ import annotations

import asyncio
import weakref
import zlib

from aiohttp import web

from gateway.connections import reading_body
from gateway.errors import BadRequest, GatewayError, PayloadTooLarge

INFLATE_FLOOR = 1 << 20  # bodies may always inflate to 1 MiB, whatever their ratio
# One body inflates at a time: compressed bodies are rare, and a flood of them (bombs) then
# takes at most one core's worth of inflating, never the event loop's share.
_INFLATING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)  # one per event loop (a semaphore belongs to the loop it first waits on)
_CHUNK = 256 * 1024


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"


class UnsupportedEncoding(GatewayError):
    status = 415
    type = "invalid_request_error"


def _too_large(limit: int, what: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body {what} is over server.max_body_bytes ({limit} bytes)",
        code="body_too_large",
    )


async def read_body(
    request: web.Request, max_bytes: int, timeout_s: float, max_ratio: float
) -> bytes:
    """The decoded body, or a ``GatewayError`` (400/408/413/415) that says what was wrong."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity", "gzip", "x-gzip", "deflate"):
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding[:40]!r} is not supported; send identity, gzip or deflate",
            code="unsupported_content_encoding",
        )
    length = request.content_length
    if length is not None and length > max_bytes:
        raise _too_large(max_bytes, f"({length} bytes)")
    content = request.content
    if content.is_eof() and not content.exception():
        # The common case: the whole body came with the headers. Nothing to wait for, so no
        # timer and no mark on the connection.
        raw = content.read_nowait()
        if len(raw) > max_bytes:
            raise _too_large(max_bytes, "on the wire")
    else:
        try:
            async with asyncio.timeout(timeout_s):
                with reading_body(request):
                    raw = await _read_wire(request, max_bytes)
        except TimeoutError:  # answered, then closed (aiohttp lingers at most 2 s)
            raise RequestTimeout(
                "the request body did not arrive within server.body_timeout_s",
                code="request_timeout",
            ) from None
    if encoding in ("", "identity"):
        return raw
    budget = min(max_bytes, max(INFLATE_FLOOR, int(len(raw) * max_ratio)))
    loop = asyncio.get_running_loop()
    inflating = _INFLATING.get(loop)
    if inflating is None:
        inflating = _INFLATING[loop] = asyncio.Semaphore(1)
    async with inflating:
        return await asyncio.to_thread(_inflate, raw, encoding, budget, max_bytes)


async def _read_wire(request: web.Request, max_bytes: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = await request.content.read(_CHUNK)
        except RuntimeError as exc:  # aiohttp's "Connection closed.": the client, or shed
            raise ConnectionResetError("the connection closed while the body was read") from exc
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes, "on the wire")
        parts.append(chunk)


def _inflate_refusal(budget: int, max_bytes: int) -> PayloadTooLarge:
    if budget == max_bytes:
        return _too_large(max_bytes, "once decoded")
    return PayloadTooLarge(
        f"request body inflates to over {budget} bytes, more than "
        "server.max_inflate_ratio times its size on the wire",
        code="body_too_large",
    )


def _inflate(raw: bytes, encoding: str, budget: int, max_bytes: int) -> bytes:
    """Decode one gzip or deflate layer into at most ``budget`` bytes."""
    if encoding in ("gzip", "x-gzip"):
        decoders = [zlib.decompressobj(16 + zlib.MAX_WBITS)]
    else:  # RFC 9110's deflate is zlib-wrapped; some clients send raw deflate
        decoders = [zlib.decompressobj(zlib.MAX_WBITS), zlib.decompressobj(-zlib.MAX_WBITS)]
    error: zlib.error | None = None
    for decoder in decoders:
        try:
            out = decoder.decompress(raw, budget + 1)
        except zlib.error as exc:
            error = exc
            continue
        if len(out) > budget:
            raise _inflate_refusal(budget, max_bytes)
        if not decoder.eof or decoder.unused_data:
            raise BadRequest(f"the {encoding} request body is truncated or has trailing data")
        return out
    raise BadRequest(f"the request body is not valid {encoding} data ({error})")
