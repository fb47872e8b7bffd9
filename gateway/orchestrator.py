"""The request's way through the gateway, in order, in one place.

``Orchestrator.handle`` is the only function that knows the order of the stages; each stage is
a method below with typed inputs and outputs, backed by its package (``gateway.stages``,
``gateway.upstream``, ``routing``, ``cache``). Every answer, whatever produced it, leaves
through the one relay path (``gateway.upstream.relay``) with the same ``RelayPlan``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.call import (
    LABELS_KEY,
    REQUEST_ID,
    STATUS_KEY,
    Call,
    Dialect,
    Leases,
    UserQuery,
    read_body,
    upstream_headers,
)
from gateway.errors import BadRequest, GatewayError, Unavailable, stopping
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import RequestTiming, SloTracker
from gateway.protocol.openai import Endpoint, ParsedRequest, parse_request
from gateway.protocol.usage import UsageTap, asks_usage, with_usage
from gateway.runtime import Destination, Runtime
from gateway.stages.cache import (
    Lookup,
    cache_headers,
    cache_state,
    replayed,
    storable,
)
from gateway.stages.limits import LimitStage, Quota
from gateway.stages.record import Recorder, Served, Watch, ms_since
from gateway.upstream.attempt import Attempt
from gateway.upstream.attempts import AttemptOpener
from gateway.upstream.relay import ANSWER_STARTED, Relayed, RelayPlan, relay, send_answer
from routing.admission import AdmissionRejected

if TYPE_CHECKING:  # the tier stage imports numpy: loaded only for policies with tiers
    from gateway.stages.tiers import TierChoice

__all__ = ["LABELS_KEY", "STATUS_KEY", "Orchestrator"]

_NO_TICKET = nullcontext()  # reusable: a surface that does not queue has nothing to release
UNKNOWN_MODEL = "unknown"  # the model label of requests that never named a served model

_OPERATION = {
    Endpoint.CHAT: "chat",
    Endpoint.COMPLETIONS: "text_completion",
    Endpoint.EMBEDDINGS: "embeddings",
    Endpoint.RESPONSES: "chat",
    Endpoint.MESSAGES: "chat",
}


class Orchestrator:
    def __init__(self, metrics: GatewayMetrics, slo: SloTracker) -> None:
        self.metrics = metrics
        self.slo = slo
        self.recorder = Recorder(metrics, slo)
        self.opener = AttemptOpener(metrics)
        self.limits = LimitStage(metrics.usage)

    async def handle(
        self, request: web.Request, rt: Runtime, endpoint: Endpoint
    ) -> web.StreamResponse:
        # Counted whatever happens; the model label is an alias only once it resolved (a
        # caller's arbitrary name never becomes a label: /metrics stays small and valid).
        request[LABELS_KEY] = (UNKNOWN_MODEL, "", "")
        return await self.run(await self.accept(request, rt, endpoint))  # who, what, which surface

    async def handle_dialect(
        self, request: web.Request, rt: Runtime, tenant: str, dialect: Dialect, started: float
    ) -> web.StreamResponse:
        """A request in another client API, already read and translated by its handler
        (``started``: ``time.perf_counter()`` before it read the body)."""
        request[LABELS_KEY] = (UNKNOWN_MODEL, "", "")
        call = self.call_for(request, rt, tenant, dialect.parsed, dialect, started)
        return await self.run(call)

    async def run(self, call: Call) -> web.StreamResponse:
        # One coroutine frame, not a wrapper around another: every resumption of the request
        # passes through each frame on its stack.
        try:
            rt = call.rt
            # An attempt a stage left open is released when this ends (``Call.leases``).
            with self.recorder.outcome(call) as done, call.leases:
                targets = rt.targets(call.parsed.model, call.parsed.endpoint)  # unknown model: 404
                call.request[LABELS_KEY] = (call.parsed.model, "", "")
                # The tenant's limits and budget (429 here); its usage and cost when this ends.
                async with self.limits.limited(call, targets) as quota:
                    lookup = await self.look_up(call)  # exact, then semantic cache
                    if lookup.hit is not None:
                        response = done(await self.serve_cached(call, lookup, quota))
                        self.audit_cache(call, lookup, targets)  # a sampled semantic hit, re-asked
                        return response
                    # Tiered aliases: small or large, or cascade (neither under a budget downgrade)
                    tier = None if quota.downgraded else await self.choose_tier(call)
                    targets = tier.targets if tier is not None else quota.targets
                    with await self.admit(call, targets[0]):  # priority admission
                        if tier is not None and tier.cascade:
                            served = await self.serve_cascade(call, tier, lookup, quota)
                        else:
                            served = await self.serve_direct(call, targets, tier, lookup, quota)
                    self.recorder.record(call, served)  # latency per replica, the SLO, the span
                    self.fill_cache(call, lookup, served, quota)  # in the background, if it fits
                    return done(served.relayed)
        except GatewayError:
            _label_tried(call)
            raise
        except asyncio.CancelledError as exc:
            _label_tried(call)
            if not stopping(exc) or call.request.get(ANSWER_STARTED):
                raise
            # The server's drain reached its bound before an answer began: a 503 to retry
            # elsewhere, not a dropped connection (a stream already begun is ended by the relay).
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            raise Unavailable(
                "the gateway is shutting down; retry the request",
                code="shutting_down",
                headers={"Retry-After": "1"},
            ) from None

    # --- 1. who, what, which surface ----------------------------------------------------------

    async def accept(self, request: web.Request, rt: Runtime, endpoint: Endpoint) -> Call:
        started = time.perf_counter()
        tenant = rt.authenticate(request.headers)
        parsed = parse_request(endpoint, await read_body(request, rt.policy.server))
        return self.call_for(request, rt, tenant, parsed, None, started)

    def call_for(
        self,
        request: web.Request,
        rt: Runtime,
        tenant: str,
        parsed: ParsedRequest,
        dialect: Dialect | None,
        started: float | None = None,
    ) -> Call:
        started = time.perf_counter() if started is None else started
        # Limits and cost settle on real usage: a stream is asked to report it at its end, and
        # the usage chunk is taken out again for a client that did not ask (a dialect's encoder
        # reads it and re-tells the answer itself).
        strip_usage = False
        if parsed.stream and parsed.endpoint.generates and not asks_usage(parsed.body):
            parsed = with_usage(parsed)
            strip_usage = dialect is None
        plan = rt.surface_for(tenant, request.headers.get(rt.surface_header))
        request_id = request.get(REQUEST_ID, "")
        # The span and TTFT both start at the request's arrival (``gateway.observability.spans``).
        span = rt.telemetry.start_request(
            operation=_OPERATION[parsed.endpoint],
            request_model=parsed.model,
            headers=request.headers,
            body=parsed.body,
            started=started,
            request_id=request_id,
        )
        if span.keeps_decisions:  # unsampled and untraced: no mapping to build
            span.decision(
                {
                    "tenant": tenant,
                    "surface": plan.name,
                    "priority": plan.priority,
                    "budget.ttft_ms": plan.budget.ttft_ms,
                    "budget.itl_ms": plan.budget.itl_ms,
                    "budget.total_ms": plan.budget.total_ms,
                }
            )
        total_ms = plan.budget.total_ms
        session = request.headers.get("x-session-id") or parsed.body.get("user")
        return Call(
            request=request,
            rt=rt,
            tenant=tenant,
            parsed=parsed,
            plan=plan,
            span=span,
            started=started,
            deadline=started + total_ms / 1000 if plan.actions.deadline and total_ms else None,
            headers=upstream_headers(request),
            query=UserQuery(rt.embedder, parsed.user_text),
            session_key=session if isinstance(session, str) else None,
            dialect=dialect,
            strip_usage=strip_usage,
            leases=Leases(request_id),
        )

    # --- 2. cache --------------------------------------------------------------------------

    async def look_up(self, call: Call) -> Lookup:
        cache, policy = call.rt.cache, call.plan.cache
        if cache is None or policy is None or not call.parsed.endpoint.generates:
            return Lookup(None)
        with call.span.child("gateway.cache.lookup"):
            lookup = await cache.lookup(call, policy)
        call.span.decision(lookup.span_attributes())  # outcome, rule, the gate's verdict
        return lookup

    async def serve_cached(self, call: Call, lookup: Lookup, quota: Quota) -> Relayed:
        assert lookup.hit is not None  # the caller's branch
        self.slo.observe(call.plan.name, RequestTiming(ms_since(call.started)))
        quota.cache_hit = True  # no upstream tokens, no cost
        quota.downgraded = None  # the stored answer is served, not the downgrade model's
        plan = self.relay_plan(
            call,
            cache_headers(lookup.hit, call.rt.policy.server.route_detail_headers),
            Watch(),
            None,
            quota,
        )
        answer = replayed(lookup.hit)
        self.recorder.cached(call, answer)
        return await send_answer(call.request, answer, plan)

    def audit_cache(self, call: Call, lookup: Lookup, targets: list[Destination]) -> None:
        """In the background: the question upstream too, to measure the gate's false hits."""
        cache = call.rt.cache
        if cache is not None:
            cache.audit_later(call, lookup, targets, self.opener)

    # --- 3. tier ---------------------------------------------------------------------------

    async def choose_tier(self, call: Call) -> TierChoice | None:
        config = call.rt.tiered(call.parsed.model)
        if config is None:
            return None
        if not call.parsed.endpoint.generates:
            raise BadRequest(
                f"model '{call.parsed.model}' is a tiered alias for chat and completions; "
                "embeddings need a model served by one backend",
                param="model",
            )
        tiers = call.rt.tiers
        if tiers is None:  # prepare() builds the stage for every policy with a tiered alias
            raise Unavailable("the tier router is not loaded", code="tiers_unavailable")
        tier = await tiers.choose(call, config)
        if not tier.cascade:
            self.metrics.tiers.labels(call.parsed.model, "route", tier.name).inc()
        call.span.decision(
            {
                "tier": tier.name,
                "tier.mode": tier.config.mode,
                "tier.difficulty": round(tier.score, 4),
                "tier.threshold": round(tier.threshold, 4),
            }
        )
        return tier

    # --- 4. admission -----------------------------------------------------------------------

    async def admit(self, call: Call, target: Destination) -> AbstractContextManager[object]:
        """Wait in priority order while the target's pool is saturated; the ticket (released
        when its ``with`` ends), or nothing to release when the surface does not queue."""
        queue, plan = target.pool.admission, call.plan
        if not plan.actions.admission or queue is None:
            return _NO_TICKET
        budget_ms = plan.budget.ttft_ms or plan.budget.total_ms
        max_wait = (
            None if budget_ms is None else budget_ms / 1000 - (time.perf_counter() - call.started)
        )
        try:
            ticket = await queue.acquire(plan.priority, max_wait)
        except AdmissionRejected as exc:
            call.span.decision({"admission": exc.reason})
            raise Unavailable(
                str(exc), code=exc.reason, headers={"Retry-After": str(exc.retry_after_s)}
            ) from exc
        if ticket.waited_s:
            call.span.decision({"admission.waited_ms": round(ticket.waited_s * 1000, 2)})
        return ticket

    # --- 5. upstream and relay ---------------------------------------------------------------

    async def serve_direct(
        self,
        call: Call,
        targets: list[Destination],
        tier: TierChoice | None,
        lookup: Lookup,
        quota: Quota,
    ) -> Served:
        """Choose a replica, open the upstream (retries, fallbacks, hedging), relay the answer."""
        attempt = await self.opener.open(call, targets)
        _label(call, attempt)  # known now, should the client leave
        watch = Watch.of(call, lookup)
        headers = {
            **_attempt_headers(call, attempt),
            **(tier.headers() if tier else {}),
            **cache_state(lookup),
        }
        plan = self.relay_plan(call, headers, watch, attempt, quota)
        fallback = attempt.target is not targets[0]  # answers for this request alone
        return Served(await relay(call.request, attempt, plan), watch, degraded=fallback)

    async def serve_cascade(
        self, call: Call, tier: TierChoice, lookup: Lookup, quota: Quota
    ) -> Served:
        """The small tier first, held to the commit point, then kept or escalated."""
        tiers = call.rt.tiers
        assert tiers is not None  # choose_tier returned a choice only with the stage loaded
        judged = await tiers.judge(call, tier, self.opener)
        # Counted, and the small answer paid for, before the large tier is asked: whatever it
        # does next (fails, the client leaves), the escalation happened and was paid.
        verdict, escalated = judged.verdict, judged.escalate
        outcome = "escalated" if escalated else "kept"
        self.metrics.tiers.labels(call.parsed.model, "cascade", outcome).inc()
        call.span.decision(
            {
                "tier": "large" if escalated else "small",  # the tier that answers
                "cascade.escalated": escalated,
                "cascade.reason": verdict.reason,
                "cascade.score": round(verdict.score, 4),
            }
        )
        discarded = judged.discarded()
        if discarded is not None:
            quota.spent.append(discarded)
        out = await tiers.answer(call, tier, judged, self.opener)
        if out.fallback:  # the held small answer is served after all: paid as the answer
            if discarded is not None:
                quota.spent.remove(discarded)
            call.span.decision({"tier": "small", "tier.fallback": True})
        attempt = out.attempt
        _label(call, attempt)
        watch = Watch.of(call, lookup)
        headers = {
            **_attempt_headers(call, attempt),
            **tier.headers(),
            **out.headers,
            **cache_state(lookup),
        }
        plan = self.relay_plan(call, headers, watch, attempt, quota)
        if out.held is not None:  # kept, or escalated and the large tier failed (degraded)
            relayed = await send_answer(call.request, out.held, plan, attempt)
            return Served(relayed, watch, degraded=verdict.escalate)
        return Served(await relay(call.request, attempt, plan), watch)

    def relay_plan(
        self,
        call: Call,
        headers: dict[str, str],
        watch: Watch,
        attempt: Attempt | None,
        quota: Quota,
    ) -> RelayPlan:
        """How this request's answer goes back: the deadline, who watches the bytes, what is
        metered (the usage chunk, taken out of the stream when the client did not ask)."""
        parsed = call.parsed
        headers = {
            **headers,
            **quota.headers(),
            "x-gateway-surface": call.plan.name,
            "x-request-id": call.request[REQUEST_ID],  # never the upstream's, streams included
        }
        watchers = watch.feeders()
        if attempt is not None:
            quota.opened(attempt)
            if parsed.stream:
                quota.tap = UsageTap(strip=call.strip_usage)
                if not call.strip_usage:
                    watchers = (*watchers, quota.tap.watch)
        on_gap = None
        if attempt is not None and parsed.stream:
            pool, replica = attempt.target.pool.name, attempt.decision.replica.name
            on_gap = self.metrics.itl_child(parsed.model, pool, replica).observe
        return RelayPlan(
            stream=parsed.stream,
            chat=parsed.endpoint is Endpoint.CHAT,
            include_usage=call.include_usage,
            deadline=call.deadline,
            headers=headers,
            watchers=watchers,
            on_gap=on_gap,
            max_response_bytes=call.rt.policy.server.max_response_bytes,
            client=call.dialect,
            filter=quota.tap if call.strip_usage else None,
            on_answer=quota.on_answer,
            estimate=quota.estimate_json,
        )

    # --- 6. after the answer -----------------------------------------------------------------

    def fill_cache(self, call: Call, lookup: Lookup, served: Served, quota: Quota) -> None:
        """Store a complete answer to the request as the client asked it: never one cut by the
        deadline, shortened by the gateway's ``cap_output``, made by a spent budget's
        downgrade model, a fallback backend, or a cascade's small tier standing in for a failed
        large one (each would be replayed to requests that get the full answer)."""
        result, attempt = served.relayed.result, served.relayed.attempt
        cache, policy = call.rt.cache, call.plan.cache
        if cache is None or policy is None or result.status != 200 or result.deadline_hit:
            return
        if quota.downgraded is not None or served.degraded:
            return
        if attempt is not None and attempt.capped:
            return
        # An answer cut at a token limit is the answer to this request only when the limit was
        # the client's own (the cache key holds it), not a default of the replica's.
        cut_ok = _output_limit(call.parsed)
        capture = served.watch.capture
        answer: Callable[[], bytes | None] = (
            storable(result.body, cut_ok)
            if capture is None
            else functools.partial(capture.assembled, cut_ok)
        )
        cache.fill_later(call, lookup, policy, answer)


def _output_limit(parsed: ParsedRequest) -> bool:
    """The client set the answer's token limit (``max_tokens``; Responses' and Messages' own
    limits arrive as chat's)."""
    body = parsed.body
    return any(
        isinstance(body.get(name), int) and not isinstance(body.get(name), bool)
        for name in ("max_tokens", "max_completion_tokens")
    )


def _label(call: Call, attempt: Attempt) -> None:
    """The request's metric labels: the model asked for, the backend and replica serving it."""
    pool, replica = attempt.target.pool.name, attempt.decision.replica.name
    call.request[LABELS_KEY] = (call.parsed.model, pool, replica)


def _label_tried(call: Call) -> None:
    """A request that ended with no answer served (an upstream time-out, a 502, the client
    gone) is labelled with the replica its last attempt went to, when one was tried."""
    labels = call.request.get(LABELS_KEY)
    if call.tried is not None and labels is not None and not labels[2]:
        call.request[LABELS_KEY] = (labels[0], *call.tried)


def _attempt_headers(call: Call, attempt: Attempt) -> dict[str, str]:
    headers = {"x-gateway-replica": f"{attempt.target.pool.name}/{attempt.decision.replica.name}"}
    if call.rt.policy.server.route_detail_headers:
        headers["x-gateway-route-reason"] = attempt.decision.reason
        headers["x-gateway-prefix-match"] = str(attempt.decision.matched_prefix)
    if attempt.hedged:
        headers["x-gateway-hedge"] = attempt.winner
    return headers
