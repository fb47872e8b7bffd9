"""Cross-cutting concerns of every request, as aiohttp middlewares (outermost first).

``context_middleware``: the request id in and out, and one metrics observation per API request
whatever its end (the orchestrator leaves its labels and status on the request).
``error_middleware``: every error leaves as OpenAI's error JSON with the right status, never a
stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.errors import GatewayError, error_body
from gateway.keys import METRICS, REQUEST_ID
from gateway.orchestrator import LABELS_KEY, STATUS_KEY

log = logging.getLogger("llm_gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id", "")[:128] or os.urandom(12).hex()
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away and aiohttp cancelled the handler
        labels = request.get(LABELS_KEY)
        if labels is not None:
            model, backend, replica = labels
            request.app[METRICS].observe_request(
                model, backend, replica, 499, time.perf_counter() - started
            )
        raise
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    labels = request.get(LABELS_KEY)
    if labels is not None:
        status = request.get(STATUS_KEY, response.status)
        model, backend, replica = labels
        request.app[METRICS].observe_request(
            model, backend, replica, status, time.perf_counter() - started
        )
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        message = (
            exc.reason if exc.status != 404 else f"unknown route {request.method} {request.path}"
        )
        return web.json_response(
            error_body(message, type_.get(exc.status, "invalid_request_error")), status=exc.status
        )
    except Exception:
        log.exception(
            "unhandled error in %s %s (request %s)",
            request.method,
            request.path,
            request.get(REQUEST_ID),
        )
        return web.json_response(
            error_body("internal gateway error", "server_error", "internal_error"), status=500
        )
