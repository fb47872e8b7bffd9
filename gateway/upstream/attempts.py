"""Choose a replica and open the upstream request, under the surface's budget.

Order per target (the model's backend, then each fallback): the router chooses among the
available replicas; with ``budget_routing`` a replica predicted to miss the TTFT budget yields
to one predicted to meet it; with ``cap_output`` ``max_tokens`` is lowered so the answer fits
``total_ms``; with hedging, if no first chunk has come by the hedge delay, the same request goes
to a second replica (the router's choice, unless the latency tracker predicts it slow) and
the first to produce a chunk wins (the other is closed at once, so its replica aborts it, and
its elapsed time is recorded as a lower bound of that replica's TTFT). A failure before the first byte (connect error, 5xx) moves on to another
replica once, then to the next target. Time-outs end the request (504): retrying would double
the wait.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict

from gateway.errors import Unavailable, UpstreamError, UpstreamTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import AttemptSpan, RequestSpan
from gateway.protocol.openai import ParsedRequest
from gateway.runtime import Destination, Runtime, SurfacePlan
from gateway.upstream.client import AttemptFailed, UpstreamClient, UpstreamRequest, UpstreamResponse
from gateway.upstream.race import race_first_chunk
from policies.backends import TimeoutConfig
from routing.admission import VLLM_PRIORITY
from routing.latency import choose_for_budget
from routing.output_cap import cap_max_tokens, requested_max_tokens, with_max_tokens
from routing.pool import BackendPool
from routing.prompt_text import render_for_routing
from routing.replica import LoadGuard, Replica
from routing.router import RoutingDecision, RoutingRequest


@dataclass(slots=True)
class Attempt:
    """An upstream response whose headers arrived (and, for hedged streams, its first chunk)."""

    target: Destination
    decision: RoutingDecision
    routing: RoutingRequest
    response: UpstreamResponse  # aiohttp's, or a provider's translating adapter
    guard: LoadGuard
    span: AttemptSpan
    opened_at: float  # perf_counter when the request was sent
    first: bytes = b""  # body bytes already read (hedged streams)
    first_at: float | None = None
    winner: str = "primary"  # or "hedge"
    hedged: bool = False

    async def discard(self) -> None:
        """Close a losing or abandoned attempt: the replica sees the connection go."""
        self.response.close()
        self.guard.release()
        self.span.end("lost")


@dataclass(slots=True)
class OpenRequest:
    """What opening needs to know about the request (built once by the orchestrator)."""

    parsed: ParsedRequest
    tenant: str
    plan: SurfacePlan
    span: RequestSpan
    started: float  # perf_counter at arrival
    deadline: float | None  # perf_counter by which the answer must be complete
    headers: CIMultiDict[str]  # headers forwarded upstream
    session_key: str | None = None
    prompt_text: str | None = field(default=None)

    def routing_text(self) -> str:
        if self.prompt_text is None:
            self.prompt_text = render_for_routing(self.parsed.body)
        return self.prompt_text


class AttemptOpener:
    def __init__(self, client: UpstreamClient, metrics: GatewayMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def open(self, rt: Runtime, req: OpenRequest, targets: list[Destination]) -> Attempt:
        failures: list[AttemptFailed] = []
        for target in targets:
            pool = target.pool
            timeouts = rt.policy.backends[pool.name].timeouts
            routing = RoutingRequest(
                model=target.upstream_model,
                prompt_text=req.routing_text() if pool.needs_prompt_text else "",
                tenant=req.tenant,
                session_key=req.session_key,
            )
            tried: set[str] = set()
            for turn in range(2):  # one try and one retry on another replica
                candidates = [r for r in pool.available() if r.base_url not in tried]
                decision = self._choose(rt, pool, candidates, routing, req.plan)
                if decision is None:
                    break
                tried.add(decision.replica.base_url)
                try:
                    return await self._attempt(
                        rt, req, target, decision, routing, candidates, timeouts, turn, tried
                    )
                except AttemptFailed as exc:
                    if not exc.retryable:
                        raise UpstreamTimeout(str(exc), code="upstream_timeout") from exc
                    failures.append(exc)
        if not failures:
            raise Unavailable(
                f"no healthy replica can serve model '{req.parsed.model}'",
                code="no_healthy_replica",
                headers={"Retry-After": rt.retry_after},
            )
        raise UpstreamError(
            f"upstream failed after {len(failures)} attempt(s): {failures[-1]}", code="bad_gateway"
        )

    def _choose(
        self,
        rt: Runtime,
        pool: BackendPool,
        candidates: list[Replica],
        routing: RoutingRequest,
        plan: SurfacePlan,
    ) -> RoutingDecision | None:
        decision = pool.router.choose(candidates, routing)
        ttft_budget = plan.budget.ttft_ms
        if decision is None or not plan.actions.budget_routing or ttft_budget is None:
            return decision
        better = choose_for_budget(decision.replica, candidates, rt.latency, ttft_budget)
        if better is decision.replica:
            return decision
        return RoutingDecision(better, "budget", 0, {"router_choice": decision.replica.name})

    async def _attempt(
        self,
        rt: Runtime,
        req: OpenRequest,
        target: Destination,
        decision: RoutingDecision,
        routing: RoutingRequest,
        candidates: list[Replica],
        timeouts: TimeoutConfig,
        turn: int,
        tried: set[str],
    ) -> Attempt:
        pool = target.pool
        hedge = req.plan.hedge
        delay = None
        peers = [r.base_url for r in candidates]
        if hedge is not None and turn == 0 and len(candidates) > 1:
            delay = hedge.delay_s(decision.replica.base_url, peers, req.plan.budget.ttft_ms)
        read_first = delay is not None and req.parsed.stream

        async def primary() -> Attempt:
            return await self._one(rt, req, target, decision, routing, timeouts, read_first, False)

        if delay is None:
            return await primary()
        assert hedge is not None

        sent: list[tuple[Replica, float]] = []  # the hedge's replica and when it was sent

        async def second() -> Attempt:
            rest = [r for r in pool.available() if r.base_url not in tried]
            choice = pool.router.choose(rest, routing)
            if choice is None:
                raise AttemptFailed("no_replica", "no replica left to hedge on", True)
            target_replica = hedge.target(choice.replica, rest)
            if target_replica is not choice.replica:
                choice = RoutingDecision(
                    target_replica, "hedge_latency", 0, {"router_choice": choice.replica.name}
                )
            tried.add(target_replica.base_url)
            sent.append((target_replica, time.perf_counter()))
            return await self._one(rt, req, target, choice, routing, timeouts, read_first, True)

        started = time.perf_counter()
        outcome = await race_first_chunk(
            primary,
            second,
            delay,
            allow_hedge=lambda: hedge.allow(
                decision.replica.base_url, peers, (time.perf_counter() - started) * 1000
            ),
            discard=Attempt.discard,
        )
        attempt = outcome.value
        attempt.hedged = outcome.hedged
        attempt.winner = outcome.winner
        if outcome.hedged:
            self.metrics.hedge(pool.name, outcome.winner)
            if read_first and outcome.loser_error is None:
                # The loser was cancelled before its first chunk: its TTFT is censored.
                now = time.perf_counter()
                if outcome.winner == "hedge":
                    hedge.lost(decision.replica, (now - started) * 1000)
                elif sent:
                    hedge.lost(sent[0][0], (now - sent[0][1]) * 1000)
        return attempt

    async def _one(
        self,
        rt: Runtime,
        req: OpenRequest,
        target: Destination,
        decision: RoutingDecision,
        routing: RoutingRequest,
        timeouts: TimeoutConfig,
        read_first: bool,
        is_hedge: bool,
    ) -> Attempt:
        pool, replica, provider = target.pool, decision.replica, target.provider
        body = self._body(rt, req, target, replica)  # a provider may refuse the request (400)
        span = req.span.attempt(
            base_url=replica.base_url,
            upstream_model=target.upstream_model,
            backend=pool.name,
            replica=replica.name,
            hedge=is_hedge,
            provider=None if provider is None else pool.settings.kind,
        )
        headers = req.headers.copy()
        headers.update(pool.auth_headers() if provider is None else provider.headers)
        if provider is None and req.plan.name != "default" and "priority" not in req.parsed.body:
            # The surface's priority for replicas started with --scheduling-policy priority
            # (others ignore it); a client's own `priority` field is left to win.
            headers["X-Vllm-Priority"] = str(VLLM_PRIORITY[req.plan.priority])
        span.inject(headers)
        path = req.parsed.endpoint.value if provider is None else provider.path
        first_byte_s = timeouts.first_byte_s
        if req.deadline is not None:
            first_byte_s = min(first_byte_s, max(req.deadline - time.perf_counter(), 0.001))
            timeouts = timeouts.model_copy(update={"first_byte_s": first_byte_s})
        guard = LoadGuard(replica)
        opened_at = time.perf_counter()
        response: UpstreamResponse | None = None
        try:
            response = await self.client.open(
                replica, UpstreamRequest(path, body, headers), timeouts
            )
            if provider is not None:
                response = provider.wrap(response, req.parsed)
            attempt = Attempt(target, decision, routing, response, guard, span, opened_at)
            if read_first and response.status == 200:
                attempt.first = await _first_chunk(response, replica, first_byte_s)
                attempt.first_at = time.perf_counter()
                span.first_chunk()
        except AttemptFailed as exc:
            if response is not None:
                response.close()
            guard.release()
            span.end(exc.outcome)
            self.metrics.attempt(pool.name, replica.name, exc.outcome)
            replica.record_failure(str(exc))
            pool.router.on_complete(decision, routing, False)
            raise
        except BaseException:  # cancelled (client gone, or a hedge lost)
            if response is not None:
                response.close()
            guard.release()
            span.end("cancelled")
            raise
        self.metrics.attempt(pool.name, replica.name, "ok" if response.status < 400 else "http_4xx")
        replica.record_success()
        return attempt

    def _body(self, rt: Runtime, req: OpenRequest, target: Destination, replica: Replica) -> bytes:
        parsed, plan = req.parsed, req.plan
        total_ms = plan.budget.total_ms
        cap = None
        if plan.actions.cap_output and total_ms is not None and parsed.endpoint.generates:
            cap = cap_max_tokens(
                total_ms=total_ms,
                elapsed_ms=(time.perf_counter() - req.started) * 1000,
                ttft_ms=rt.latency.predict(replica) or 0.0,
                itl_ms=rt.latency.itl_ms(replica.base_url),
                requested=requested_max_tokens(parsed.body),
            )
            if cap is not None:
                req.span.decision({"output_cap": cap})
        if target.provider is not None:
            return target.provider.body(parsed, target.upstream_model, cap)
        if cap is not None:
            capped = with_max_tokens({**parsed.body, "model": target.upstream_model}, cap)
            return json.dumps(capped).encode()
        return parsed.body_for(target.upstream_model)


async def _first_chunk(response: UpstreamResponse, replica: Replica, limit_s: float) -> bytes:
    """Read until the first bytes of the body (a hedge races on this, not on the headers)."""
    try:
        async with asyncio.timeout(limit_s):
            data = await response.content.readany()
    except TimeoutError as exc:
        raise AttemptFailed("timeout", f"{replica.name} sent no token in time", False) from exc
    except aiohttp.ClientError as exc:
        raise AttemptFailed("connect_error", f"{replica.name} broke the stream", True) from exc
    if not data:
        raise AttemptFailed("connect_error", f"{replica.name} ended the stream at once", True)
    return data
