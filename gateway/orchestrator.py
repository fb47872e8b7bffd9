"""The request's way through the gateway, in order, in one place.

``Orchestrator.handle`` is the only function that knows the order of the stages; each stage is
a plain call with typed inputs and outputs owned by its package. Later stages (cache lookup and
fill, tier choice, budget enforcement) slot in where the comments say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.errors import PayloadTooLarge, Unavailable, UpstreamError, UpstreamTimeout
from gateway.metrics import GatewayMetrics
from gateway.protocol import Endpoint, ParsedRequest, parse_request
from gateway.relay import RelayResult, relay_body, relay_stream
from gateway.runtime import Runtime, Target
from gateway.upstream import FORWARDED_HEADERS, AttemptFailed, UpstreamClient, UpstreamRequest
from routing.replica import LoadGuard
from routing.router import RoutingDecision, RoutingRequest

# Keys under which the orchestrator leaves labels for the metrics middleware.
LABELS_KEY = web.RequestKey("llm_gateway.labels", tuple[str, str, str])
STATUS_KEY = web.RequestKey("llm_gateway.status", int)


@dataclass(slots=True)
class Attempt:
    target: Target
    decision: RoutingDecision
    routing: RoutingRequest
    response: aiohttp.ClientResponse
    guard: LoadGuard


class Orchestrator:
    def __init__(self, client: UpstreamClient, metrics: GatewayMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def handle(
        self, request: web.Request, rt: Runtime, endpoint: Endpoint
    ) -> web.StreamResponse:
        started = time.perf_counter()
        # 1. who is calling
        tenant = rt.authenticate(request.headers.get("Authorization"))
        # 2. what they ask for (parsed once, forwarded untouched)
        parsed = parse_request(endpoint, await read_body(request, rt.max_body_bytes))
        request[LABELS_KEY] = (parsed.model, "", "")
        # 3. which surface, hence which budget (enforced by the budgets stage, a later issue)
        rt.surface_for(tenant, request.headers.get(rt.surface_header))
        # 4. which backends may serve the model: the primary, then its fallbacks
        targets = rt.targets(parsed.model)
        # 5. (cache lookup goes here)
        # 6. choose a replica and open the upstream request, retrying before the first byte
        attempt = await self.open_upstream(request, rt, parsed, targets, tenant)
        pool, replica = attempt.target.pool, attempt.decision.replica
        request[LABELS_KEY] = (parsed.model, pool.name, replica.name)
        ok = False
        try:
            # 7. relay the answer as it arrives
            response, result = await self.relay(request, parsed, attempt, started)
            ok = result.status < 400
            request[STATUS_KEY] = result.status
            return response
        finally:
            attempt.guard.release()
            pool.router.on_complete(attempt.decision, attempt.routing, ok)
            # 8. (cache fill, router feedback and span attributes go here)

    async def open_upstream(
        self,
        request: web.Request,
        rt: Runtime,
        parsed: ParsedRequest,
        targets: list[Target],
        tenant: str,
    ) -> Attempt:
        headers = _upstream_headers(request)
        failures: list[AttemptFailed] = []
        for target in targets:
            pool = target.pool
            timeouts = rt.policy.backends[pool.name].timeouts
            routing = RoutingRequest(model=target.upstream_model, prompt_text="", tenant=tenant)
            body = parsed.body_for(target.upstream_model)
            tried: set[str] = set()
            for _ in range(2):  # one try and one retry on another replica
                candidates = [r for r in pool.available() if r.base_url not in tried]
                decision = pool.router.choose(candidates, routing)
                if decision is None:
                    break
                replica = decision.replica
                tried.add(replica.base_url)
                guard = LoadGuard(replica)
                try:
                    response = await self.client.open(
                        replica,
                        UpstreamRequest(
                            parsed.endpoint.value, body, _with_auth(headers, pool.auth_headers())
                        ),
                        timeouts,
                    )
                except AttemptFailed as exc:
                    guard.release()
                    self.metrics.attempt(pool.name, replica.name, exc.outcome)
                    replica.record_failure(str(exc))
                    pool.router.on_complete(decision, routing, False)
                    if not exc.retryable:
                        raise UpstreamTimeout(str(exc), code="upstream_timeout") from exc
                    failures.append(exc)
                    continue
                except BaseException:
                    guard.release()
                    raise
                self.metrics.attempt(
                    pool.name, replica.name, "ok" if response.status < 400 else "http_4xx"
                )
                replica.record_success()
                return Attempt(target, decision, routing, response, guard)
        if not failures:
            raise Unavailable(
                f"no healthy replica can serve model '{parsed.model}'",
                code="no_healthy_replica",
                headers={"Retry-After": rt.retry_after},
            )
        raise UpstreamError(
            f"upstream failed after {len(failures)} attempt(s): {failures[-1]}", code="bad_gateway"
        )

    async def relay(
        self, request: web.Request, parsed: ParsedRequest, attempt: Attempt, started: float
    ) -> tuple[web.StreamResponse, RelayResult]:
        pool, replica = attempt.target.pool, attempt.decision.replica
        extra = {
            "x-gateway-replica": f"{pool.name}/{replica.name}",
            "x-gateway-route-reason": attempt.decision.reason,
        }
        upstream = attempt.response
        streaming = parsed.stream and upstream.status == 200
        if not streaming:
            return await relay_body(request, upstream, extra)
        model = parsed.model
        return await relay_stream(
            request,
            upstream,
            extra,
            started,
            self.metrics.ttft_child(model, pool.name, replica.name),
            self.metrics.itl_child(model, pool.name, replica.name),
        )


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


def _with_auth(headers: CIMultiDict[str], auth: dict[str, str]) -> CIMultiDict[str]:
    if not auth:
        return headers
    out = headers.copy()
    out.update(auth)
    return out


async def read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None:
        if length > limit:
            raise PayloadTooLarge(
                f"request body is {length} bytes; the limit is {limit}", code="body_too_large"
            )
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"request body exceeds the limit of {limit} bytes", code="body_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)
