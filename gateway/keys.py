"""The typed keys of the app's state: what ``create_app`` and its ``cleanup_ctx`` put there."""

from __future__ import annotations

from aiohttp import web

from gateway.call import REQUEST_ID
from gateway.connections import ConnectionLimits
from gateway.live import LivePolicy
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import SloTracker
from gateway.orchestrator import Orchestrator

LIVE = web.AppKey("live", LivePolicy)  # the running runtime and its reload (set at startup)
METRICS = web.AppKey("metrics", GatewayMetrics)
SLO = web.AppKey("slo", SloTracker)
LIMITS = web.AppKey("limits", ConnectionLimits)  # the policy's connection bounds, live
ORCHESTRATOR = web.AppKey("orchestrator", Orchestrator)

__all__ = ["LIMITS", "LIVE", "METRICS", "ORCHESTRATOR", "REQUEST_ID", "SLO"]
