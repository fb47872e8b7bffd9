"""The aiohttp application: built by composition from a validated policy, no globals.

``create_app`` wires routes and middlewares and keeps the process-wide parts that no policy
decides (the metrics registry, the SLO tracker, the orchestrator) under typed ``AppKey``\\ s.
Everything the policy decides is one ``Runtime``, built and closed by one ``cleanup_ctx``
(``_live_policy``) and swapped as one reference by a reload (``gateway.live``): pools,
the embedder, the cache, the tier router, telemetry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from gateway import admin, dialect_routes, handlers
from gateway.build import Clock, build_runtime
from gateway.connections import ConnectionLimits
from gateway.keys import LIMITS, LIVE, METRICS, ORCHESTRATOR, SLO
from gateway.live import LivePolicy, budgets
from gateway.middleware import (
    anthropic_request_id,
    cors_middleware,
    cors_on_prepare,
    gateway_middleware,
)
from gateway.observability.metrics import GatewayMetrics, KVEventCollector, ReloadCollector
from gateway.observability.slo import SloCollector, SloTracker
from gateway.observability.tracing import SpanDropCollector, Telemetry
from gateway.observability.usage_metrics import LimiterCollector
from gateway.orchestrator import Orchestrator
from gateway.stages.cache import CacheCollector
from gateway.workgroup import WorkerContext, add_group_routes
from policies.loader import PolicySource
from policies.schema import Policy
from routing.pool import all_replicas

_SETUP = web.AppKey("setup", tuple)


def create_app(
    policy: Policy,
    source: PolicySource | str = "<policy>",
    policy_path: Path | None = None,
    telemetry: Telemetry | None = None,
    clock: Clock | None = None,
    group: WorkerContext | None = None,
) -> web.Application:
    """``telemetry`` replaces the one built from the policy (tests pass an in-memory exporter);
    ``clock`` the time the limits read (tests move it; by default, the limit store's);
    ``group``: this process is one worker of a pre-forked group, whose ``/metrics`` and
    ``/admin/*`` answer for every worker (``gateway.workgroup``)."""
    if isinstance(source, str):
        source = PolicySource(source)
    # Bodies are read by gateway.protocol.body under the policy's limits, never by
    # request.read(); client_max_size only backs that up.
    app = web.Application(
        middlewares=[cors_middleware, gateway_middleware],
        client_max_size=policy.server.max_body_bytes,
    )
    metrics = GatewayMetrics(lambda: all_replicas(list(app[LIVE].current.pools.values())))
    slo = SloTracker(budgets(policy))
    metrics.registry.register(SloCollector(lambda: slo))
    metrics.registry.register(CacheCollector(lambda: app[LIVE].current.cache))
    metrics.registry.register(LimiterCollector(lambda: app[LIVE].current.limiter))
    metrics.registry.register(SpanDropCollector(lambda: app[LIVE].current.telemetry))
    metrics.registry.register(ReloadCollector(lambda: app[LIVE].reload_counts()))
    metrics.registry.register(KVEventCollector(lambda: app[LIVE].current.pools.values()))
    app[METRICS] = metrics
    app[SLO] = slo
    app[ORCHESTRATOR] = Orchestrator(metrics, slo)
    app[LIMITS] = ConnectionLimits.of(policy.server)
    workers, group_policy = (group.count, (group.run_dir, group.policy)) if group else (1, None)
    app[_SETUP] = (policy, source, policy_path, telemetry, clock, workers, group_policy)
    app.cleanup_ctx.append(_live_policy)
    app[admin.ADMIN_ACCESS] = admin.AdminAccess()
    app.on_response_prepare.append(cors_on_prepare)
    app.on_response_prepare.append(anthropic_request_id)
    handlers.add_routes(app.router, metrics=group is None)
    dialect_routes.add_routes(app.router)
    admin.add_routes(app.router, group=group is not None)
    if group is not None:
        add_group_routes(app, group, admin.AppAdmin(app, group.index))
    return app


async def _live_policy(app: web.Application) -> AsyncIterator[None]:
    """Build the policy's runtime (pools, cache, embedder, tiers, telemetry); close it at the end."""
    policy, source, path, telemetry, clock, workers, group_policy = app[_SETUP]
    runtime = await build_runtime(policy, source, telemetry=telemetry, clock=clock)
    limits = app[LIMITS]
    live = LivePolicy(
        runtime,
        path,
        app[SLO],
        telemetry,
        clock,
        on_reload=lambda p: limits.update(p.server),
        workers=workers,
        group=group_policy,  # a worker reloads what its supervisor read, never the file
    )
    app[LIVE] = live
    yield
    await live.close()
