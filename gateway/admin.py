"""The admin endpoints: reload, workers, surfaces and queues, cache purge, the cache's audit
report and its thresholds, usage.

Who may call them: with ``server.admin_token_env`` set, whoever sends ``Authorization: Bearer
<that token>`` (from any address: behind a proxy on the host every caller looks like
loopback, so the peer address proves nothing). Without a token, loopback callers only, and
only while the gateway listens on loopback; bound to another address, the admin API answers
403 until a token is configured. Without a token a call must also come from a tool, not a web
page: no ``Origin``, no cross-site ``Sec-Fetch-Site``, a loopback ``Host`` (403 otherwise).

``AppAdmin`` is what one process answers about itself; a pre-forked worker group asks each
worker for it over its control socket and answers for all (``gateway.workgroup``). The usage
report is read (``usage_query``, ``AppAdmin.usage_records``) and written (``usage_answer``) in
steps, so that a group can add its workers' records up in between.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.errors import BadRequest, Forbidden, NotFound, Unauthorized, Unavailable, error_body
from gateway.keys import LIVE, METRICS, SLO
from gateway.limits.memory import MemoryStore
from gateway.limits.store import StoreUnavailable
from gateway.limits.usage import report
from gateway.limits.windows import WINDOW_KINDS, Window, window_of
from policies.loader import PolicyError

if TYPE_CHECKING:
    from gateway.stages.cache import CacheStage

log = logging.getLogger("llm_gateway")


@dataclass
class AdminAccess:
    listens_beyond_loopback: bool = False  # set by `serve` from the address it binds


ADMIN_ACCESS = web.AppKey("admin_access", AdminAccess)
UsageRecords = dict[str, dict[str, int]]  # tenant -> its usage record's fields


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What ``GET /admin/usage`` asks: a window, and one tenant (``one``) or every tenant."""

    window: Window
    tenants: list[str]
    one: bool


class AppAdmin:
    """One process's own answers (``gateway.workgroup.LocalAdmin``)."""

    def __init__(self, app: web.Application, worker: int | None = None) -> None:
        self._app = app
        self._worker = worker

    @property
    def policy_path(self) -> Path | None:
        return self._app[LIVE].path

    def metrics_text(self) -> bytes:
        return self._app[METRICS].render()

    def surfaces_view(self) -> dict[str, Any]:
        rt = self._app[LIVE].current
        queues = {
            name: pool.admission.snapshot()
            for name, pool in rt.pools.items()
            if pool.admission is not None
        }
        return {"surfaces": self._app[SLO].view(), "admission": queues}

    def worker_info(self) -> dict[str, Any]:
        live = self._app[LIVE]
        return {
            "worker": self._worker,
            "pid": os.getpid(),
            "requests": self._app[METRICS].requests_answered(),
            "reloads": live.reloads,
            "reload_error": live.reload_error,
            "models": live.current.model_names(),
        }

    @property
    def usage_shared(self) -> bool:
        """The usage records are in a store every process reads (Redis), not in this one."""
        return not isinstance(self._app[LIVE].current.limiter.store, MemoryStore)

    async def usage_records(self, tenants: list[str] | None, window: Window) -> UsageRecords:
        """The tenants' (None: every tenant of the running policy) records of ``window``."""
        rt = self._app[LIVE].current
        records: UsageRecords = {}
        for tenant in rt.limits.tenants if tenants is None else tenants:
            try:
                records[tenant] = await rt.limiter.record_of(tenant, window)
            except StoreUnavailable as exc:
                raise Unavailable(
                    "the limit store is unavailable", headers={"Retry-After": "5"}
                ) from exc
        return records

    def cache_report(self) -> dict[str, Any]:
        return _cache(self._app).report()

    def reset_thresholds(self, namespace: str | None) -> None:
        _cache(self._app).cache.semantic.gate.reset(namespace)

    async def purge_cache(self, tenant: str, namespace: str | None) -> int:
        cache = _cache(self._app)
        from cache.store import StoreUnavailable as CacheStoreUnavailable

        try:
            return await cache.cache.purge(tenant, namespace)
        except CacheStoreUnavailable as exc:
            raise Unavailable(
                "the cache store is unavailable", headers={"Retry-After": "5"}
            ) from exc


def _cache(app: web.Application) -> CacheStage:
    cache = app[LIVE].current.cache
    if cache is None:
        raise NotFound("no surface of the running policy has a cache")
    return cache


def add_routes(router: web.UrlDispatcher, group: bool = False) -> None:
    """The admin API; in a worker group every route is ``gateway.workgroup``'s, which answers
    for the whole group."""
    if group:
        return
    router.add_post("/admin/reload", _reload)
    router.add_get("/admin/workers", _workers)
    router.add_get("/admin/surfaces", _surfaces)
    router.add_delete("/admin/cache", _purge_cache)
    router.add_get("/admin/usage", _usage)
    router.add_get("/admin/cache", _cache_report)
    router.add_delete("/admin/cache/thresholds", _reset_thresholds)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def check_admin(request: web.Request) -> None:
    """Who may call the admin API (the module's docstring); raises otherwise."""
    token = request.app[LIVE].current.admin_token
    if token:
        if not _bearer(request, token):
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
    if not _from_this_host(request):
        raise Forbidden(
            "without an admin token the admin API answers only tools on this host, not a "
            "browser page (Origin, Sec-Fetch-Site) or another host name (Host); set "
            "server.admin_token_env to call it otherwise",
            code="admin_token_required",
        )


def check_metrics(request: web.Request) -> None:
    """``/metrics`` asks for ``server.metrics_token_env``'s token when the policy sets one (its
    labels name tenants, their spend and the replicas' addresses)."""
    token = request.app[LIVE].current.metrics_token
    if token and not _bearer(request, token):
        raise Unauthorized(
            "/metrics needs 'Authorization: Bearer <metrics token>' (server.metrics_token_env)",
            code="invalid_metrics_token",
        )


def _bearer(request: web.Request, token: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), token.encode()
    )


def _from_this_host(request: web.Request) -> bool:
    """A loopback peer is not enough without a token: a web page open on this machine can make
    the browser POST here (a simple request, no preflight), and DNS rebinding lets a page read
    the answers under its own host name. Tools (curl, the reload sidecar) send neither an
    ``Origin`` nor ``Sec-Fetch-Site``, and name a loopback host."""
    headers = request.headers
    if "Origin" in headers or headers.get("Sec-Fetch-Site", "none") != "none":
        return False
    host = request.host.rsplit(":", 1)[0] if not request.host.startswith("[") else request.host
    host = host.split("]")[0].lstrip("[")
    return is_loopback(host)


async def _surfaces(request: web.Request) -> web.Response:
    """Rolling TTFT, inter-token and total percentiles and budget attainment per surface."""
    check_admin(request)
    return web.json_response(AppAdmin(request.app).surfaces_view())


async def _workers(request: web.Request) -> web.Response:
    """This one process (a worker group lists each of its workers)."""
    check_admin(request)
    return web.json_response({"workers": [AppAdmin(request.app).worker_info()], "missing": []})


async def _purge_cache(request: web.Request) -> web.Response:
    """``DELETE /admin/cache?tenant=T[&namespace=N]``: drop a tenant's (or one scope's) entries."""
    check_admin(request)
    tenant = request.query.get("tenant")
    if not tenant:
        raise BadRequest("the 'tenant' query parameter is required", param="tenant")
    removed = await AppAdmin(request.app).purge_cache(tenant, request.query.get("namespace"))
    return web.json_response({"purged": removed, "tenant": tenant})


async def _cache_report(request: web.Request) -> web.Response:
    """``GET /admin/cache``: outcomes, the audit (audited and false hits per namespace, their
    interval, the threshold in force, tightenings, the audit's upstream cost)."""
    check_admin(request)
    return web.json_response(AppAdmin(request.app).cache_report())


async def _reset_thresholds(request: web.Request) -> web.Response:
    """``DELETE /admin/cache/thresholds[?namespace=N]``: back to the shipped operating point."""
    check_admin(request)
    namespace = request.query.get("namespace")
    AppAdmin(request.app).reset_thresholds(namespace)
    return web.json_response({"reset": namespace or "all"})


async def _reload(request: web.Request) -> web.Response:
    """Reload the policy file (loopback callers only: the admin API is not exposed)."""
    check_admin(request)
    live = request.app[LIVE]
    if live.path is None:
        return no_policy_file()
    try:
        rt = await live.reload()
    except PolicyError as exc:
        return policy_rejected(exc)
    return web.json_response({"status": "reloaded", "policy": rt.source.file})


def no_policy_file() -> web.Response:
    """400 to a reload of a gateway started without a policy file."""
    return web.json_response(
        error_body("no policy file to reload", "invalid_request_error"), status=400
    )


def policy_rejected(exc: PolicyError) -> web.Response:
    """400 to a reload whose file did not load (``file:line: key: message``); nothing changed.

    Logged as a SIGHUP's rejection is: whoever edits the file may not be who reads the answer.
    The issues name keys and lines, never the values of secrets (those come from the env)."""
    log.error(
        "policy reload rejected (POST /admin/reload); still running the previous policy:\n%s", exc
    )
    return web.json_response(
        error_body(
            "policy rejected; the running policy is unchanged:\n" + str(exc),
            "invalid_request_error",
            "invalid_policy",
        ),
        status=400,
    )


async def _usage(request: web.Request) -> web.Response:
    """``GET /admin/usage?tenant=T&window=day|week|month``: a tenant's spend, remaining budget,
    tokens, and per surface its cost per 1k requests beside its latency percentiles.

    Spend, tokens and costs are every instance's (the limit store's records); the latency
    percentiles are this instance's rolling window (``/admin/surfaces``). Without ``tenant``,
    every tenant of the policy.
    """
    check_admin(request)
    query = usage_query(request)
    records = await AppAdmin(request.app).usage_records(query.tenants, query.window)
    return web.json_response(usage_answer(request.app, query, records))


def usage_query(request: web.Request) -> UsageQuery:
    """The window and tenants ``GET /admin/usage`` asks for (400 / 404 for what is not)."""
    rt = request.app[LIVE].current
    kind = request.query.get("window", "month")
    if kind not in WINDOW_KINDS:
        raise BadRequest("'window' must be day, week or month", param="window")
    tenants = rt.limits.tenants
    asked = request.query.get("tenant")
    if asked is not None and asked not in tenants:
        raise NotFound(f"no tenant named {asked!r} in the running policy")
    window = window_of(kind, rt.limiter.now_s())
    return UsageQuery(window, list(tenants) if asked is None else [asked], asked is not None)


def usage_answer(app: web.Application, query: UsageQuery, records: UsageRecords) -> dict[str, Any]:
    """The report of ``query`` from the tenants' records, with this process's latency."""
    rt = app[LIVE].current
    latency = app[SLO].view()
    out = []
    for tenant in query.tenants:
        spec = rt.policy.tenants.get(tenant)
        budget = rt.limits.subject(tenant, "default").budget if spec is not None else None
        fields = records.get(tenant, {})
        row = report(tenant, query.window, fields, budget, rt.limits.surfaces)
        for name, surface in row["surfaces"].items():
            slo = latency.get(name)
            if slo is not None:
                surface["latency_ms"] = {k: slo[k] for k in ("ttft_ms", "total_ms")}
                surface["latency_requests"] = slo["requests"]
        out.append(row)
    return out[0] if query.one else {"tenants": out}
