"""The request's way through the gateway, in order, in one place.

``Orchestrator.handle`` is the only function that knows the order of the stages; each stage is
a plain call with typed inputs and outputs owned by its package.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from multidict import CIMultiDict

from gateway.errors import BadRequest, GatewayError, PayloadTooLarge, Unavailable
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import RequestTiming, SloTracker
from gateway.observability.summary import ResponseSummary, StreamSummarizer, summarize_body
from gateway.observability.tracing import RequestSpan, Telemetry
from gateway.protocol.openai import Endpoint, ParsedRequest, parse_request
from gateway.runtime import Runtime, SurfacePlan
from gateway.stages.cache import CacheStage, QueryEmbedding, StreamCapture, last_user_text, replay
from gateway.stages.tiers import TierChoice, TierStage
from gateway.upstream.attempts import Attempt, AttemptOpener, OpenRequest
from gateway.upstream.client import FORWARDED_HEADERS, UpstreamClient
from gateway.upstream.relay import RelayResult, StreamPlan, relay_body, relay_stream
from routing.admission import AdmissionRejected, Ticket
from routing.latency import queue_of
from routing.pool import BackendPool

if TYPE_CHECKING:
    from cache.semantic import CacheHit, CachePlan

# Keys under which the orchestrator leaves labels for the metrics middleware.
LABELS_KEY = web.RequestKey("llm_gateway.labels", tuple[str, str, str])
STATUS_KEY = web.RequestKey("llm_gateway.status", int)

_OPERATION = {
    Endpoint.CHAT: "chat",
    Endpoint.COMPLETIONS: "text_completion",
    Endpoint.EMBEDDINGS: "embeddings",
}


class Orchestrator:
    def __init__(
        self,
        client: UpstreamClient,
        metrics: GatewayMetrics,
        telemetry: Telemetry,
        slo: SloTracker,
        cache: CacheStage | None = None,
    ) -> None:
        self.opener = AttemptOpener(client, metrics)
        self.tiers = TierStage(self.opener, metrics)
        self.metrics = metrics
        self.telemetry = telemetry
        self.slo = slo
        self.cache = cache
        self.embedder = cache.embedder if cache is not None else None

    async def handle(
        self, request: web.Request, rt: Runtime, endpoint: Endpoint
    ) -> web.StreamResponse:
        started = time.perf_counter()
        # 1. who is calling
        tenant = rt.authenticate(request.headers.get("Authorization"))
        # 2. what they ask for (parsed once; the bytes are forwarded untouched)
        parsed = parse_request(endpoint, await read_body(request, rt.max_body_bytes))
        request[LABELS_KEY] = (parsed.model, "", "")
        # 3. which surface, hence which budget, priority and actions
        plan = rt.surface_for(tenant, request.headers.get(rt.surface_header))
        span = self.telemetry.start_request(
            operation=_OPERATION[endpoint],
            request_model=parsed.model,
            headers=request.headers,
            body=parsed.body,
        )
        span.decision(_plan_attributes(tenant, plan))
        status = 500
        error_type: str | None = None
        try:
            # 4. which backends may serve the model: the primary, then its fallbacks
            targets = rt.targets(parsed.model)
            query = QueryEmbedding(self.embedder, last_user_text(parsed))
            # 5. cache: exact, then semantic; a hit is replayed and the request ends here
            cache_plan = None
            if self.cache is not None and plan.cache is not None and endpoint.generates:
                cache_plan = self.cache.plan(request, parsed, plan.cache, tenant, plan.name)
                with span.child("gateway.cache.lookup"):
                    hit = await self.cache.lookup(cache_plan, plan.cache, query)
                span.decision(_cache_attributes(hit, cache_plan.request is not None))
                if hit is not None:
                    status = 200
                    request[STATUS_KEY] = status
                    self.slo.observe(plan.name, RequestTiming(_ms_since(started)))
                    return await replay(request, parsed, hit, {"x-gateway-surface": plan.name})
            # 6. tiered aliases: the small or the large tier by difficulty, or a cascade
            tier = None
            tiered = rt.tiered(parsed.model)
            if tiered is not None and not endpoint.generates:
                raise BadRequest(
                    f"model '{parsed.model}' is a tiered alias for chat and completions; "
                    "embeddings need a model served by one backend",
                    param="model",
                )
            if tiered is not None:
                tier = await self.tiers.choose(rt, parsed, tiered, query)
                targets = tier.targets
                span.decision(_tier_attributes(tier))
            # 7. admission: wait in priority order while the pool is saturated
            ticket = await self.admit(targets[0].pool, plan, started, span)
            try:
                open_req = _open_request(request, parsed, tenant, plan, span, started)
                capture = StreamCapture() if _fills(cache_plan) and parsed.stream else None
                if tier is not None and tier.cascade:
                    # 8-9. small tier first, held to the commit point, kept or escalated
                    outcome = await self.tiers.cascade(
                        request, rt, open_req, tier, _tier_headers(plan, tier)
                    )
                    attempt, response, result = outcome.attempt, outcome.response, outcome.result
                    _label(request, parsed, attempt)
                    attempt.guard.release()
                    attempt.span.end("ok" if result.status < 400 else "error")
                    if outcome.verdict is not None:
                        span.decision(
                            {
                                "cascade.escalated": outcome.verdict.escalate,
                                "cascade.reason": outcome.verdict.reason,
                                "cascade.score": round(outcome.verdict.score, 4),
                            }
                        )
                else:
                    # 8. choose a replica and open the upstream (retries, fallbacks, hedging)
                    attempt = await self.opener.open(rt, open_req, targets)
                    _label(request, parsed, attempt)  # known now, should the client leave
                    # 9. relay the answer as it arrives
                    response, result = await self.relay(
                        request,
                        parsed,
                        plan,
                        attempt,
                        span,
                        open_req.deadline,
                        capture,
                        _tier_headers(plan, tier) if tier is not None else None,
                    )
            finally:
                if ticket is not None:
                    ticket.release()
            status = result.status
            request[STATUS_KEY] = status
            # 10. record: latency per replica, the surface's SLO, the span's outcome
            self.record(rt, plan, attempt, result, started, span, parsed.model)
            # 11. cache fill, in the background, of a complete and successful answer
            if result.status == 200 and not result.deadline_hit:
                self.fill_cache(plan, cache_plan, capture, result, query)
            return response
        except GatewayError as exc:
            status = exc.status
            if status >= 500:  # a client's error (4xx) is not the server span's error
                error_type = exc.code or exc.type
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (handler cancellation): not the server's failure
            raise
        finally:
            if status >= 500 and status != 499 and not _recorded(request):
                self.slo.observe(plan.name, RequestTiming(_ms_since(started), ok=False))
            span.end(status, error_type)

    def fill_cache(
        self,
        plan: SurfacePlan,
        cache_plan: CachePlan | None,
        capture: StreamCapture | None,
        result: RelayResult,
        query: QueryEmbedding,
    ) -> None:
        if self.cache is None or plan.cache is None or cache_plan is None:
            return
        answer = capture.assembled if capture is not None else _storable(result.body)
        self.cache.fill_later(cache_plan, plan.cache, answer, query)

    async def admit(
        self, pool: BackendPool, plan: SurfacePlan, started: float, span: RequestSpan
    ) -> Ticket | None:
        if not plan.actions.admission or pool.admission is None:
            return None
        budget_ms = plan.budget.ttft_ms or plan.budget.total_ms
        max_wait = None if budget_ms is None else budget_ms / 1000 - (time.perf_counter() - started)
        try:
            ticket = await pool.admission.acquire(plan.priority, max_wait)
        except AdmissionRejected as exc:
            span.decision({"admission": exc.reason})
            raise Unavailable(
                str(exc), code=exc.reason, headers={"Retry-After": str(exc.retry_after_s)}
            ) from exc
        if ticket.waited_s:
            span.decision({"admission.waited_ms": round(ticket.waited_s * 1000, 2)})
        return ticket

    async def relay(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        plan: SurfacePlan,
        attempt: Attempt,
        span: RequestSpan,
        deadline: float | None,
        capture: StreamCapture | None = None,
        more_headers: dict[str, str] | None = None,
    ) -> tuple[web.StreamResponse, RelayResult]:
        pool, replica = attempt.target.pool, attempt.decision.replica
        extra = {
            **(more_headers or {}),
            "x-gateway-replica": f"{pool.name}/{replica.name}",
            "x-gateway-route-reason": attempt.decision.reason,
            "x-gateway-prefix-match": str(attempt.decision.matched_prefix),
            "x-gateway-surface": plan.name,
        }
        if attempt.hedged:
            extra["x-gateway-hedge"] = attempt.winner
        if plan.cache is not None and self.cache is not None and parsed.endpoint.generates:
            extra["x-gateway-cache"] = "miss"
        upstream = attempt.response
        ok = False
        response: web.StreamResponse
        try:
            if not (parsed.stream and upstream.status == 200):
                response, result = await relay_body(upstream, extra)
            else:
                summarizer = StreamSummarizer() if span.recording else None
                stream_plan = StreamPlan(
                    first=attempt.first,
                    first_at=attempt.first_at,
                    deadline=deadline,
                    chat=parsed.endpoint is Endpoint.CHAT,
                    on_read=_readers(summarizer, capture),
                    on_gap=self.metrics.itl_child(parsed.model, pool.name, replica.name).observe,
                )
                response, result = await relay_stream(request, upstream, extra, stream_plan)
                if summarizer is not None:
                    _span_response(span, summarizer.summary, replica.base_url)
            ok = result.status < 400
            return response, result
        finally:
            attempt.guard.release()
            attempt.span.end("won" if attempt.hedged and ok else ("ok" if ok else "error"))
            pool.router.on_complete(attempt.decision, attempt.routing, ok)

    def record(
        self,
        rt: Runtime,
        plan: SurfacePlan,
        attempt: Attempt,
        result: RelayResult,
        started: float,
        span: RequestSpan,
        model: str,
    ) -> None:
        replica = attempt.decision.replica
        key = replica.base_url
        ttft_ms = None
        if result.first_at is not None:
            ttft_ms = (result.first_at - started) * 1000
            pool_name = attempt.target.pool.name
            self.metrics.ttft_child(model, pool_name, replica.name).observe(ttft_ms / 1000)
            rt.latency.observe_ttft(
                key, (result.first_at - attempt.opened_at) * 1000, queue=queue_of(replica)
            )
            span.first_token(ttft_ms)
        itl_ms = result.mean_gap_ms()
        if itl_ms is not None:
            rt.latency.observe_itl(key, itl_ms)
        if result.body is not None:
            _span_response(span, summarize_body(result.body), key)
        if result.deadline_hit:
            self.metrics.deadlines.labels(plan.name).inc()
        span.decision(
            {
                "backend": attempt.target.pool.name,
                "replica": replica.name,
                "route.reason": attempt.decision.reason,
                "route.prefix_match": attempt.decision.matched_prefix,
                "hedge.fired": attempt.hedged,
                "hedge.winner": attempt.winner if attempt.hedged else None,
                "deadline.hit": result.deadline_hit or None,
            }
        )
        if 400 <= result.status < 500:
            return  # the client's error: not the surface's latency
        timing = RequestTiming(_ms_since(started), ttft_ms, itl_ms, ok=result.status < 500)
        verdict = self.slo.observe(plan.name, timing)
        budget = plan.budget
        if budget.ttft_ms is not None and ttft_ms is not None:
            span.decision({"budget.ttft_headroom_ms": round(budget.ttft_ms - ttft_ms, 2)})
            if verdict.ttft:
                span.budget_breach("ttft", budget.ttft_ms, ttft_ms)
        if verdict.itl and budget.itl_ms is not None and itl_ms is not None:
            span.budget_breach("itl", budget.itl_ms, itl_ms)
        if verdict.total and budget.total_ms is not None:
            span.budget_breach("total", budget.total_ms, timing.total_ms)


def _label(request: web.Request, parsed: ParsedRequest, attempt: Attempt) -> None:
    """The request's metric labels: the model asked for, the backend and replica serving it."""
    request[LABELS_KEY] = (parsed.model, attempt.target.pool.name, attempt.decision.replica.name)


def _tier_headers(plan: SurfacePlan, tier: TierChoice) -> dict[str, str]:
    return {
        "x-gateway-surface": plan.name,
        "x-gateway-tier": tier.name,
        "x-gateway-difficulty": f"{tier.score:.4f}",
    }


def _tier_attributes(tier: TierChoice) -> dict[str, str | float | None]:
    return {
        "tier": tier.name,
        "tier.mode": tier.config.mode,
        "tier.difficulty": round(tier.score, 4),
        "tier.threshold": round(tier.threshold, 4),
    }


def _fills(plan: CachePlan | None) -> bool:
    return plan is not None and plan.request is not None and plan.fill


def _storable(body: bytes | None) -> Callable[[], bytes | None]:
    def check() -> bytes | None:
        from cache.replay import is_storable

        if body is None:
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return body if isinstance(data, dict) and is_storable(data) else None

    return check


def _readers(
    summarizer: StreamSummarizer | None, capture: StreamCapture | None
) -> Callable[[bytes], None] | None:
    if summarizer is None and capture is None:
        return None
    if capture is None:
        assert summarizer is not None
        return summarizer.feed
    if summarizer is None:
        return capture.feed

    def both(data: bytes) -> None:
        summarizer.feed(data)
        capture.feed(data)

    return both


def _cache_attributes(hit: CacheHit | None, involved: bool) -> dict[str, str | float | None]:
    if not involved:
        return {"cache": "skipped"}
    if hit is None:
        return {"cache": "miss"}
    return {"cache": hit.kind, "cache.similarity": hit.similarity}


def _open_request(
    request: web.Request,
    parsed: ParsedRequest,
    tenant: str,
    plan: SurfacePlan,
    span: RequestSpan,
    started: float,
) -> OpenRequest:
    session = request.headers.get("x-session-id") or parsed.body.get("user")
    total_ms = plan.budget.total_ms
    deadline = started + total_ms / 1000 if plan.actions.deadline and total_ms else None
    return OpenRequest(
        parsed=parsed,
        tenant=tenant,
        plan=plan,
        span=span,
        started=started,
        deadline=deadline,
        headers=_upstream_headers(request),
        session_key=session if isinstance(session, str) else None,
    )


def _plan_attributes(tenant: str, plan: SurfacePlan) -> dict[str, str | float | None]:
    return {
        "tenant": tenant,
        "surface": plan.name,
        "priority": plan.priority,
        "budget.ttft_ms": plan.budget.ttft_ms,
        "budget.itl_ms": plan.budget.itl_ms,
        "budget.total_ms": plan.budget.total_ms,
    }


def _span_response(span: RequestSpan, summary: ResponseSummary, server_url: str) -> None:
    span.response(
        model=summary.model,
        response_id=summary.response_id,
        input_tokens=summary.input_tokens,
        output_tokens=summary.output_tokens,
        finish_reasons=summary.finish_reasons,
        server_url=server_url,
    )


def _recorded(request: web.Request) -> bool:
    return STATUS_KEY in request


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


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
