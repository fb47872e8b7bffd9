"""The admin endpoints: reload, surfaces and queues, cache purge.

Who may call them: with ``server.admin_token_env`` set, whoever sends ``Authorization: Bearer
<that token>`` (from any address: behind a proxy on the host every caller looks like
loopback, so the peer address proves nothing). Without a token, loopback callers only, and
only while the gateway listens on loopback; bound to another address, the admin API answers
403 until a token is configured.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import BadRequest, Forbidden, NotFound, Unauthorized, Unavailable, error_body
from gateway.keys import LIVE, SLO
from policies.loader import PolicyError


@dataclass
class AdminAccess:
    listens_beyond_loopback: bool = False  # set by `serve` from the address it binds


ADMIN_ACCESS = web.AppKey("admin_access", AdminAccess)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/admin/reload", _reload)
    router.add_get("/admin/surfaces", _surfaces)
    router.add_delete("/admin/cache", _purge_cache)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _loopback_only(request: web.Request) -> None:
    """The admin check (the name kept from when it was the only rule)."""
    token = request.app[LIVE].current.admin_token
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), token.encode()
        )
        if not ok:
            raise Unauthorized(
                "the admin API needs 'Authorization: Bearer <admin token>' "
                "(server.admin_token_env)",
                code="invalid_admin_token",
            )
        return
    if request.app[ADMIN_ACCESS].listens_beyond_loopback:
        raise Forbidden(
            "the admin API is off: the gateway listens beyond loopback and no admin token is "
            "set (server.admin_token_env)",
            code="admin_token_required",
        )
    if request.remote is None or not is_loopback(request.remote):
        raise NotFound(f"unknown route {request.method} {request.path}")


async def _surfaces(request: web.Request) -> web.Response:
    """Rolling TTFT, inter-token and total percentiles and budget attainment per surface."""
    _loopback_only(request)
    rt = request.app[LIVE].current
    queues = {
        name: pool.admission.snapshot()
        for name, pool in rt.pools.items()
        if pool.admission is not None
    }
    return web.json_response({"surfaces": request.app[SLO].view(), "admission": queues})


async def _purge_cache(request: web.Request) -> web.Response:
    """``DELETE /admin/cache?tenant=T[&namespace=N]``: drop a tenant's (or one scope's) entries."""
    _loopback_only(request)
    cache = request.app[LIVE].current.cache
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
    live = request.app[LIVE]
    if live.path is None:
        return web.json_response(
            error_body("no policy file to reload", "invalid_request_error"), status=400
        )
    try:
        rt = await live.reload()
    except PolicyError as exc:
        return web.json_response(
            error_body(
                "policy rejected; the running policy is unchanged:\n" + str(exc),
                "invalid_request_error",
                "invalid_policy",
            ),
            status=400,
        )
    return web.json_response({"status": "reloaded", "policy": rt.source.file})
