"""The aiohttp application: built by composition from a validated policy, no globals.

Resources (the upstream HTTP session, pools and their health loops) are opened and closed in
``cleanup_ctx``. The running ``Runtime`` is one reference that a reload swaps, and only after
the new policy validated completely: a bad file never replaces a good running policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.errors import BadRequest, GatewayError, NotFound, Unavailable, error_body
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import SloCollector, SloTracker
from gateway.observability.tracing import Telemetry
from gateway.orchestrator import LABELS_KEY, STATUS_KEY, Orchestrator
from gateway.protocol.openai import Endpoint
from gateway.runtime import Runtime, build_pools
from gateway.stages.cache import CacheCollector, CacheStage
from gateway.upstream.client import UpstreamClient
from policies.loader import PolicyError, load_policy
from policies.schema import Policy
from policies.surfaces import Budget
from routing.pool import all_replicas

log = logging.getLogger("llm_gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """What the app holds: the running runtime and the resources shared by every request."""

    def __init__(self, runtime: Runtime, policy_path: Path | None) -> None:
        self.runtime = runtime
        self.policy_path = policy_path
        self.metrics = GatewayMetrics(lambda: all_replicas(list(self.runtime.pools.values())))
        self.slo = SloTracker(_budgets(runtime.policy))
        self.metrics.registry.register(SloCollector(lambda: self.slo))
        self.telemetry = Telemetry.disabled()
        self.cache: CacheStage | None = None
        self.metrics.registry.register(CacheCollector(lambda: self.cache))
        self.session: aiohttp.ClientSession | None = None
        self.orchestrator: Orchestrator | None = None
        self._reload_lock = asyncio.Lock()

    async def reload(self) -> Runtime:
        """Load the policy file again; raises ``PolicyError`` and keeps the running one if bad."""
        if self.policy_path is None:
            raise PolicyError([])
        async with self._reload_lock:
            policy = await asyncio.to_thread(load_policy, self.policy_path)
            old = self.runtime
            pools = build_pools(policy, old.pools)
            assert self.session is not None
            fresh = [p for p in pools.values() if p not in old.pools.values()]
            await asyncio.gather(*(p.start(self.session) for p in fresh))
            self.runtime = Runtime(policy, str(self.policy_path), pools, old.latency)
            self.slo.configure(_budgets(policy))
            for pool in old.pools.values():
                if pool not in pools.values():
                    await pool.stop()
            log.info("policy reloaded from %s", self.policy_path)
            return self.runtime


def _budgets(policy: Policy) -> dict[str, Budget]:
    return {name: surface.budget for name, surface in policy.surfaces.items()}


GATEWAY = web.AppKey("gateway", Gateway)
REQUEST_ID = web.RequestKey("llm_gateway.request_id", str)


def create_app(
    policy: Policy,
    source: str = "<policy>",
    policy_path: Path | None = None,
    telemetry: Telemetry | None = None,
) -> web.Application:
    """``telemetry`` replaces the one built from the policy (tests pass an in-memory exporter)."""
    gateway = Gateway(Runtime(policy, source, build_pools(policy)), policy_path)
    if telemetry is not None:
        gateway.telemetry = telemetry
    app = web.Application(
        middlewares=[_context_middleware, _error_middleware], client_max_size=64 * 1024 * 1024
    )
    app[GATEWAY] = gateway
    app.cleanup_ctx.append(_resources)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/admin/reload", _reload)
    app.router.add_get("/admin/surfaces", _surfaces)
    app.router.add_delete("/admin/cache", _purge_cache)
    return app


async def _resources(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False)
    gateway.session = session
    owns_telemetry = not gateway.telemetry.enabled
    if owns_telemetry:
        gateway.telemetry = Telemetry.from_config(gateway.runtime.policy.telemetry)
    policy = gateway.runtime.policy
    if any(s.cache is not None for s in policy.surfaces.values()) or policy.needs_embeddings():
        gateway.cache = await CacheStage.open(policy.cache_store, policy.needs_embeddings())
    gateway.orchestrator = Orchestrator(
        UpstreamClient(session), gateway.metrics, gateway.telemetry, gateway.slo, gateway.cache
    )
    pools = list(gateway.runtime.pools.values())
    await asyncio.gather(*(p.start(session) for p in pools))
    yield
    await asyncio.gather(*(p.stop() for p in gateway.runtime.pools.values()))
    await session.close()
    if gateway.cache is not None:
        await gateway.cache.aclose()
    if owns_telemetry:
        await asyncio.to_thread(gateway.telemetry.shutdown)


# --- middlewares -------------------------------------------------------------------------


@web.middleware
async def _context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in and out; one metrics observation per API request, whatever its end."""
    request_id = request.headers.get("x-request-id", "")[:128] or os.urandom(12).hex()
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away and aiohttp cancelled the handler
        labels = request.get(LABELS_KEY)
        if labels is not None:
            model, backend, replica = labels
            request.app[GATEWAY].metrics.observe_request(
                model, backend, replica, 499, time.perf_counter() - started
            )
        raise
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    labels = request.get(LABELS_KEY)
    if labels is not None:
        status = request.get(STATUS_KEY, response.status)
        model, backend, replica = labels
        request.app[GATEWAY].metrics.observe_request(
            model, backend, replica, status, time.perf_counter() - started
        )
    return response


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error JSON with the right status; never a stack trace."""
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


# --- handlers ----------------------------------------------------------------------------


async def _chat(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    assert gateway.orchestrator is not None
    return await gateway.orchestrator.handle(request, gateway.runtime, Endpoint.CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    assert gateway.orchestrator is not None
    return await gateway.orchestrator.handle(request, gateway.runtime, Endpoint.COMPLETIONS)


async def _embeddings(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    assert gateway.orchestrator is not None
    return await gateway.orchestrator.handle(request, gateway.runtime, Endpoint.EMBEDDINGS)


def _model_object(name: str) -> dict[str, str | int]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llm-gateway"}


async def _models(request: web.Request) -> web.Response:
    rt = request.app[GATEWAY].runtime
    rt.authenticate(request.headers.get("Authorization"))
    data = [_model_object(name) for name in rt.model_names()]
    return web.json_response({"object": "list", "data": data})


async def _model(request: web.Request) -> web.Response:
    rt = request.app[GATEWAY].runtime
    rt.authenticate(request.headers.get("Authorization"))
    name = request.match_info["model"]
    if name not in rt.model_names():
        raise NotFound(f"The model '{name}' does not exist", code="model_not_found", param="model")
    return web.json_response(_model_object(name))


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    rt = request.app[GATEWAY].runtime
    missing = rt.not_ready()
    if missing:
        return web.json_response(
            {"status": "not ready", "backends_without_healthy_replica": missing}, status=503
        )
    return web.json_response({"status": "ready", "policy": rt.source})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def _loopback_only(request: web.Request) -> None:
    if request.remote not in ("127.0.0.1", "::1"):
        raise NotFound(f"unknown route {request.method} {request.path}")


async def _surfaces(request: web.Request) -> web.Response:
    """Rolling TTFT, inter-token and total percentiles and budget attainment per surface."""
    _loopback_only(request)
    gateway = request.app[GATEWAY]
    queues = {
        name: pool.admission.snapshot()
        for name, pool in gateway.runtime.pools.items()
        if pool.admission is not None
    }
    return web.json_response({"surfaces": gateway.slo.view(), "admission": queues})


async def _purge_cache(request: web.Request) -> web.Response:
    """``DELETE /admin/cache?tenant=T[&namespace=N]``: drop a tenant's (or one scope's) entries."""
    _loopback_only(request)
    cache = request.app[GATEWAY].cache
    tenant = request.query.get("tenant")
    if not tenant:
        raise BadRequest("the 'tenant' query parameter is required", param="tenant")
    if cache is None:
        raise NotFound("no surface of the running policy has a cache")
    from cache.store import StoreUnavailable

    try:
        removed = await cache.cache.purge(tenant, request.query.get("namespace"))
    except StoreUnavailable as exc:
        raise Unavailable("the cache store is unavailable", headers={"Retry-After": "5"}) from exc
    return web.json_response({"purged": removed, "tenant": tenant})


async def _reload(request: web.Request) -> web.Response:
    """Reload the policy file (loopback callers only: the admin API is not exposed)."""
    _loopback_only(request)
    gateway = request.app[GATEWAY]
    if gateway.policy_path is None:
        return web.json_response(
            error_body("no policy file to reload", "invalid_request_error"), status=400
        )
    try:
        rt = await gateway.reload()
    except PolicyError as exc:
        return web.json_response(
            error_body(
                "policy rejected; the running policy is unchanged:\n" + str(exc),
                "invalid_request_error",
                "invalid_policy",
            ),
            status=400,
        )
    return web.json_response({"status": "reloaded", "policy": rt.source})
