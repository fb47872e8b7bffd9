"""Cross-cutting concerns of every request: one aiohttp middleware, and CORS.

``gateway_middleware``: the request id in and out (``anthropic_request_id``: also as
``request-id`` to a caller of Anthropic's API, the header its clients read); every error leaves
as OpenAI's error JSON with the right status, never a stack trace (a client that left is a 499,
not an error); one metrics observation per API request whatever its end (the orchestrator leaves
its labels and status on the request); and the access log. One layer, not one per concern: every
middleware is one more frame that each resumption of the request's coroutine passes through.
``cors_middleware`` + ``cors_on_prepare``: with ``server.cors``, preflights are answered and
every response (streams included: the signal runs before the headers are sent) carries the
CORS headers for an allowed origin.

The access log (``server.access_log``) is one line per request: peer, method, path (no query
string), status, duration, model label, backend, replica (the one that answered, else the one
last tried: ``Call.tried``) and request id. Never a header value, a key, a prompt or a
completion.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, web

from gateway.call import LABELS_KEY, STATUS_KEY
from gateway.errors import GatewayError, error_body
from gateway.keys import LIVE, METRICS, REQUEST_ID
from gateway.protocol import anthropic_messages_output as messages_out
from policies.server import CorsConfig

log = logging.getLogger("llm_gateway")
access_log = logging.getLogger("llm_gateway.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _RequestIds:
    """Request ids: 16 random hex digits drawn once per process, then a counter (8 hex digits).
    Unique across processes and workers (a forked worker draws its own) without a system call
    for randomness on every request."""

    def __init__(self) -> None:
        self._prefix = ""
        self._next = 0
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._next = 0

    def __call__(self) -> str:
        self._next = (self._next + 1) & 0xFFFFFFFF
        if self._next == 0:  # 2**32 requests in one process: a new prefix, never a repeat
            self.reset()
            self._next = 1
        return f"{self._prefix}{self._next:08x}"


_new_request_id = _RequestIds()


def _request_id(request: web.Request) -> str:
    """The caller's ``x-request-id`` when it is safe to echo, else a new one; kept on the
    request (an ``Expect`` answer, given before the handler, takes it first)."""
    request_id: str | None = request.get(REQUEST_ID)
    if request_id is None:
        request_id = request.headers.get("x-request-id", "")[:128]
        if not _safe_id(request_id):
            request_id = _new_request_id()  # none, or one not to echo in a header or a log
        request[REQUEST_ID] = request_id
    return request_id


@web.middleware
async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = _request_id(request)
    started = time.perf_counter()
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away and aiohttp cancelled the handler
        _observed(request, 499, started, request_id)
        raise
    except GatewayError as exc:
        response = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        if exc.status == 408:  # the body stopped coming: what follows on this connection is
            response.force_close()  # the rest of it, never a next request
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _http_error(request, exc)
    except ConnectionError:
        if not client_gone(request):
            response = _internal_error(request, request_id)
        else:
            # The client went away while its request was read or answered (aiohttp cancels
            # the handler only with handler_cancellation): not an error of the gateway's, so
            # no traceback; counted as 499. The answer below reaches no one.
            log.debug("client left during %s %s", request.method, _path(request))
            request[STATUS_KEY] = 499
            response = web.Response(status=499)
    except Exception:
        response = _internal_error(request, request_id)
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    _observed(request, request.get(STATUS_KEY, response.status), started, request_id)
    return response


def _observed(request: web.Request, status: int, started: float, request_id: str) -> None:
    """The request's one metrics observation (an API request's) and its access-log line."""
    labels = request.get(LABELS_KEY)
    elapsed = time.perf_counter() - started
    if labels is not None:
        model, backend, replica = labels
        request.app[METRICS].observe_request(model, backend, replica, status, elapsed)
    if request.app[LIVE].current.policy.server.access_log:
        model, backend, replica = labels or ("-", "-", "-")
        access_log.info(
            "%s %s %s %d %.1fms model=%s backend=%s replica=%s id=%s",
            request.remote, request.method, _path(request), status, elapsed * 1000,
            model or "-", backend or "-", replica or "-", request_id,
        )  # fmt: skip


def _safe_id(request_id: str) -> bool:
    """A caller's request id is echoed in a header and logged: printable ASCII, no spaces (a
    space would let it pose as more ``key=value`` fields of the access-log line)."""
    return (
        bool(request_id)
        and request_id.isascii()
        and request_id.isprintable()
        and (" " not in request_id)
    )


def _path(request: web.Request) -> str:
    """The path as sent, for a log line: ``request.path`` is percent-decoded, and a ``%0A`` in
    it would start a forged line."""
    path = request.rel_url.raw_path
    return path if path.isascii() and path.isprintable() else ascii(path)[1:-1]


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """A route's or method's error, in the caller's API: Anthropic's on its routes (or with
    ``anthropic-version``), else OpenAI's; a 405 keeps aiohttp's ``Allow``."""
    path = request.rel_url.raw_path  # as sent: "/v1/chat%2Fcompletions" is not a route
    message = exc.reason if exc.status != 404 else f"unknown route {request.method} {path}"
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    type_ = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
    return _api_error(
        request, exc.status, message, type_.get(exc.status, "invalid_request_error"), None, headers
    )


def _api_error(
    request: web.Request,
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An error answered before a route's handler runs, in the caller's API: Anthropic's on its
    routes (or with ``anthropic-version``), else OpenAI's."""
    if _anthropic(request):
        body = messages_out.error_body(messages_out.error_status(status), message)
        return web.json_response(body, status=status, headers=headers)
    return web.json_response(error_body(message, type_, code), status=status, headers=headers)


def _anthropic(request: web.Request) -> bool:
    """A caller of Anthropic's API: on its routes, or with its ``anthropic-version``."""
    return request.rel_url.raw_path.startswith("/v1/messages") or (
        "anthropic-version" in request.headers
    )


async def anthropic_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """The request id as Anthropic sends it (``request-id``, which its clients give as
    ``_request_id`` and an error's ``request_id``), beside ``x-request-id``: streams included,
    as the signal runs before any header is sent."""
    request_id = request.get(REQUEST_ID)
    if request_id and _anthropic(request):
        response.headers["request-id"] = request_id


def _internal_error(request: web.Request, request_id: str) -> web.Response:
    log.exception(
        "unhandled error in %s %s (request %s)", request.method, _path(request), request_id
    )
    return web.json_response(
        error_body("internal gateway error", "server_error", "internal_error"), status=500
    )


_PREFLIGHT_METHODS = "GET, POST, DELETE, OPTIONS"


def _allowed_origin(request: web.Request) -> tuple[CorsConfig, str] | None:
    cors = request.app[LIVE].current.policy.server.cors
    origin = request.headers.get("Origin")
    if cors is None or origin is None:
        return None
    if "*" in cors.allow_origins and not cors.allow_credentials:
        return cors, "*"
    return (cors, origin) if origin in cors.allow_origins else None


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer a CORS preflight (``OPTIONS`` with ``Access-Control-Request-Method``) itself."""
    if (
        request.method != "OPTIONS"
        or "Access-Control-Request-Method" not in request.headers
        or request.app[LIVE].current.policy.server.cors is None
    ):
        return await handler(request)
    allowed = _allowed_origin(request)
    if allowed is None:
        return web.json_response(
            error_body("origin not allowed (server.cors)", "permission_error", "cors"), status=403
        )
    cors, origin = allowed
    server = request.app[LIVE].current.policy.server
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": _PREFLIGHT_METHODS,
        "Access-Control-Allow-Headers": _allowed_headers(request, cors, server.surface_header),
        "Access-Control-Max-Age": str(cors.max_age_s),
        "Vary": "Origin",
    }
    if cors.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    return web.Response(status=204, headers=headers)


def _allowed_headers(request: web.Request, cors: CorsConfig, surface_header: str) -> str:
    """The preflight's requested headers that the policy allows (browsers match names exactly:
    a pattern such as ``X-Stainless-*`` is answered with the names it covers). The header that
    selects a surface (``server.surface_header``) is always allowed, renamed or not: a browser
    could not choose a surface otherwise."""
    asked = request.headers.get("Access-Control-Request-Headers", "")
    names = [name.strip() for name in asked.split(",") if name.strip()]
    surface = surface_header.lower()
    allowed = [name for name in names if cors.allows_header(name) or name.lower() == surface]
    plain = [name for name in cors.allow_headers if not name.endswith("*")]
    if not cors.allows_header(surface_header):
        plain.append(surface_header)
    return ", ".join(dict.fromkeys(allowed + plain))


async def cors_on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    allowed = _allowed_origin(request)
    if allowed is None:
        return
    cors, origin = allowed
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = ", ".join(cors.expose_headers)
    response.headers.add("Vary", "Origin")
    if cors.allow_credentials:
        response.headers["Access-Control-Allow-Credentials"] = "true"


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def expect_continue(request: web.Request) -> web.Response | None:
    """``Expect`` on the API's POST routes: only ``100-continue``, and only for a body the policy
    takes. A declared length over ``server.max_body_bytes`` is a 413 before the client sends a
    byte of it (aiohttp's default said "100 Continue", then refused it); another expectation is
    a 417 in JSON (aiohttp's default: plain text that echoed the header)."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        message = "only 'Expect: 100-continue' is understood"
        response = _api_error(request, 417, message, "invalid_request_error")
    elif (length := request.content_length) is not None and length > (
        limit := request.app[LIVE].current.policy.server.max_body_bytes
    ):
        message = f"request body is over server.max_body_bytes ({limit} bytes)"
        response = _api_error(request, 413, message, "invalid_request_error", "body_too_large")
    else:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None
    response.headers["x-request-id"] = _request_id(request)  # (and request-id: the signal)
    response.force_close()  # the body the client holds back never comes: the connection ends
    return response
