"""Choose a replica and open the upstream request, under the surface's budget.

Order per target (the model's backend, then each fallback): the router chooses among the
available replicas; with ``budget_routing`` a replica predicted to miss the TTFT budget yields
to one predicted to meet it; with ``cap_output`` ``max_tokens`` is lowered so the answer fits
``total_ms``; with hedging, if no first chunk has come by the hedge delay, the same request goes
to a second replica (among the others not paced after a 429: the router's ``peek``, which
moves no turn and records nothing, where it has one (a prefix router: the replica holding the
prompt's prefix), else the least loaded; unless the latency tracker predicts it slow) and the
first to produce a chunk wins (the other is closed at once, so its replica aborts it, and its
elapsed time is recorded as a lower bound of that replica's TTFT). Under the surface's
deadline (``actions.deadline``) a stream's first chunk is read here too, before its answer
goes out: none by the deadline is a 504, as no head by then is. A failure before the
first byte (connect error, 5xx) moves on to another replica once, then to the next target.
Time-outs end the request (504): retrying would double the wait.

Connections per replica are bounded (``max_connections``): the choice prefers a replica with a
free one, and a request that waited ``first_byte_s`` for one in vain (outcome
``no_connection``) was never sent: it counts nothing against the replica, moves on to another
replica only if one has a free connection, then to the next target; when nothing else failed
the client gets 503 with ``Retry-After`` (``upstream_saturated``), never a 504.

Providers' rate limits (``gateway.upstream.ratelimits``): a 429 moves on to the next target
at once (an external API's replicas share its key's limits) and never counts against the
replica's health; the last target's 429 is relayed as the provider sent it (translated for
Anthropic). A replica whose last answer said its budget is spent is waited for (up to the
backend's ``rate_limit_wait_s`` and the deadline; recorded apart from model latency) or
skipped; when every target was skipped the client gets a 429 with ``Retry-After``. A vLLM
backend's replicas are independent servers: a 429 from one moves on to another replica of the
backend (within the one retry), and a replica that asked to wait is left out while another is
available, as an ejected one is; the 429 is relayed only when no other replica is left.

What it returns is a ``gateway.upstream.attempt.Attempt`` (the load guard and span until the
answer ends), listed in the request's ``Call.leases`` as it opens; the body it sends is built
by ``gateway.upstream.body``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from gateway.call import Call
from gateway.errors import RateLimited, Unavailable, UpstreamError, UpstreamTimeout
from gateway.limits.estimate import reserve_tokens
from gateway.limits.headers import retry_headers
from gateway.observability.log_every import LogEvery
from gateway.observability.metrics import GatewayMetrics
from gateway.protocol.openai import Endpoint
from gateway.runtime import Destination
from gateway.upstream.attempt import Attempt, key_refused
from gateway.upstream.body import upstream_body
from gateway.upstream.client import (
    AttemptFailed,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamStreamError,
    open_upstream,
)
from gateway.upstream.race import race_first_chunk
from gateway.upstream.ratelimits import UpstreamLimits, retry_after_s
from routing.admission import VLLM_PRIORITY
from routing.latency import choose_for_budget
from routing.pool import BackendPool
from routing.replica import LoadGuard, Replica
from routing.router import Peeks, RoutingDecision, RoutingRequest

log = logging.getLogger("llm_gateway.upstream")
# A failing replica fails every request sent to it: one line per replica and outcome every 10 s.
_failures = LogEvery(log)


class AttemptOpener:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.limits = UpstreamLimits()  # what each provider said of its rate limits

    async def open(self, call: Call, targets: list[Destination]) -> Attempt:
        failures: list[AttemptFailed] = []
        limited_s: list[float] = []  # a rate-limited target: when it says to come back
        saturated = False  # a replica's connections stayed busy (the gateway's, not its fault)
        for target in targets:
            pool = target.pool
            routing = RoutingRequest(
                model=target.upstream_model,
                prompt_text=call.routing_text() if pool.needs_prompt_text else "",
                tenant=call.tenant,
                session_key=call.session_key,
            )
            # Self-hosted replicas are independent servers: one's 429 binds none of the others.
            independent = pool.settings.kind == "vllm"
            tried: set[str] = set()
            turn = 0
            while turn < 2:  # one try and one retry on another replica
                available = pool.available(target.upstream_model)
                candidates = [r for r in available if r.base_url not in tried]
                decision = self._choose(call, pool, candidates, routing)
                if decision is None:
                    break
                tried.add(decision.replica.base_url)
                skip = independent and len(candidates) > 1
                wait = await self._pace(call, target, decision.replica, skip)
                if wait is not None:
                    limited_s.append(wait)
                    if skip:
                        continue  # nothing was sent: another replica, as if this one were out
                    break  # its provider's limit is spent for longer than we may wait
                turn += 1
                try:
                    attempt = await self._attempt(
                        call, target, routing, decision, candidates, turn - 1, tried
                    )
                except AttemptFailed as exc:
                    # The operator's line names the replica; the caller's never does.
                    _failures.warning(
                        (pool.name, decision.replica.name, exc.outcome),
                        "attempt on %s/%s failed: %s",
                        pool.name,
                        decision.replica.name,
                        exc,
                    )
                    if exc.outcome == "rejected_key":
                        raise key_refused(pool.name, exc) from exc
                    if not exc.retryable:
                        raise UpstreamTimeout(exc.public, code="upstream_timeout") from exc
                    if exc.outcome == "no_connection":
                        saturated = True
                        if any(_has_room(r, pool) for r in candidates if r.base_url not in tried):
                            continue
                        break  # a second wait for a busy replica would double the wait
                    failures.append(exc)
                    continue
                if attempt.response.status != 429:
                    return attempt
                self.metrics.usage.upstream_limited.labels(pool.name).inc()
                # An external API's replicas share its key's limits: on to the next target.
                more = independent and turn < 2 and len(candidates) > 1
                if not more and target is targets[-1]:
                    return attempt  # nowhere else to go: the provider's 429 is relayed
                limited_s.append(retry_after_s(attempt.response.headers) or 1.0)
                await attempt.discard()
                if not more:
                    break
        if limited_s and not failures:
            raise RateLimited(
                f"every upstream of model '{call.parsed.model}' is rate limited",
                code="rate_limit_exceeded",
                headers=retry_headers(int(min(limited_s) * 1000)),
            )
        if saturated and not failures:
            raise Unavailable(
                f"every connection of the gateway to the upstreams of model "
                f"'{call.parsed.model}' is busy; retry shortly",
                code="upstream_saturated",
                headers={"Retry-After": call.rt.retry_after},
            )
        if not failures:
            raise Unavailable(
                f"no healthy replica can serve model '{call.parsed.model}'",
                code="no_healthy_replica",
                headers={"Retry-After": call.rt.retry_after},
            )
        tries = sum(f.attempts for f in failures)
        raise UpstreamError(f"{failures[-1].public} ({tries} attempt(s))", code="bad_gateway")

    async def _pace(
        self, call: Call, target: Destination, replica: Replica, skip: bool
    ) -> float | None:
        """Wait for the provider's rate limit to reset, when it is near; None: sent (or no
        need); a number: the seconds it asks, longer than this request may wait, or any wait
        when ``skip`` (another replica, not bound by this one's limit, may take it at once)."""
        wait = self.limits.wait_s(replica.base_url, lambda: _tokens(call))
        if wait <= 0:
            return None
        if skip:
            return wait
        allowed = call.rt.policy.backends[target.pool.name].rate_limit_wait_s
        if call.deadline is not None:
            allowed = min(allowed, call.deadline - time.perf_counter())
        if wait > allowed:
            return wait
        await asyncio.sleep(wait)
        self.metrics.usage.upstream_wait.labels(target.pool.name).observe(wait)
        call.span.decision({"upstream.rate_limit_wait_ms": round(wait * 1000, 2)})
        return None

    def _choose(
        self,
        call: Call,
        pool: BackendPool,
        candidates: list[Replica],
        routing: RoutingRequest,
    ) -> RoutingDecision | None:
        decision = pool.router.choose(candidates, routing)
        if decision is not None and not _has_room(decision.replica, pool):
            # Its connections are all busy: another replica that has one is better than a wait.
            roomy = [r for r in candidates if _has_room(r, pool)]
            if roomy:
                candidates = roomy
                decision = pool.router.choose(roomy, routing)
        plan = call.plan
        ttft_budget = plan.budget.ttft_ms
        if decision is None or not plan.actions.budget_routing or ttft_budget is None:
            return decision
        better = choose_for_budget(decision.replica, candidates, call.rt.latency, ttft_budget)
        if better is decision.replica:
            return decision
        return RoutingDecision(better, "budget", 0)

    async def _attempt(
        self,
        call: Call,
        target: Destination,
        routing: RoutingRequest,
        decision: RoutingDecision,
        candidates: list[Replica],
        turn: int,
        tried: set[str],
    ) -> Attempt:
        pool = target.pool
        hedge = call.plan.hedge
        delay = None
        peers: list[str] = []
        if hedge is not None and turn == 0 and len(candidates) > 1:
            peers = [r.base_url for r in candidates]
            delay = hedge.delay_s(decision.replica.base_url, peers, call.plan.budget.ttft_ms)
        read_first = delay is not None and call.parsed.stream

        if delay is None or hedge is None:  # no race: no closures, one frame less
            return await self._one(call, target, decision, read_first, False)

        async def primary() -> Attempt:
            return await self._one(call, target, decision, read_first, False)

        sent: list[tuple[Replica, float]] = []  # the hedge's replica and when it was sent

        async def second() -> Attempt:
            rest = [r for r in pool.available(target.upstream_model) if r.base_url not in tried]
            # Not one paced after its 429 (it asked to wait): the hedge would wait there too.
            rest = [r for r in rest if self.limits.wait_s(r.base_url, lambda: _tokens(call)) <= 0]
            rest = [r for r in rest if _has_room(r, pool)] or rest
            if not rest:
                raise AttemptFailed("no_replica", "no replica left to hedge on", True)
            # Not the router's ``choose``: it moves its turn, so the next request's primary
            # would land where this one's did (a slow replica, every time). A router that
            # ``Peeks`` says where it would go with nothing recorded (a prefix router: where
            # the prompt's prefix is cached); any other, the least loaded.
            router = pool.router
            advice = router.peek(rest, routing) if isinstance(router, Peeks) else None
            if advice is None:
                advice = RoutingDecision(min(rest, key=lambda r: r.outstanding), "least_loaded")
            target_replica = hedge.target(advice.replica, rest)
            choice = advice
            if target_replica is not advice.replica:
                choice = RoutingDecision(target_replica, "hedge_latency", 0)
            tried.add(target_replica.base_url)
            sent.append((target_replica, time.perf_counter()))
            try:
                attempt = await self._one(call, target, choice, read_first, True)
            except AttemptFailed as exc:
                _failures.warning(
                    (pool.name, target_replica.name, exc.outcome),
                    "hedge on %s/%s failed: %s",
                    pool.name,
                    target_replica.name,
                    exc,
                )
                raise
            if attempt.response.status == 429:
                # The hedge's replica (or its key) is limited: the primary may still answer,
                # so the race waits for it rather than relaying the hedge's 429.
                await attempt.discard()
                raise AttemptFailed("http_429", "the hedge was rate limited", True)
            return attempt

        started = time.perf_counter()
        try:
            outcome = await race_first_chunk(
                primary,
                second,
                delay,
                allow_hedge=lambda: hedge.allow(
                    decision.replica.base_url, peers, (time.perf_counter() - started) * 1000
                ),
                discard=Attempt.discard,
            )
        except AttemptFailed as exc:  # the primary's error; a hedge sent beside it failed too
            exc.attempts += len(sent)
            raise
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
        call: Call,
        target: Destination,
        decision: RoutingDecision,
        read_first: bool,
        is_hedge: bool,
    ) -> Attempt:
        pool, replica, provider = target.pool, decision.replica, target.provider
        body, capped = upstream_body(call, target, replica)  # a provider may refuse it (400)
        span = call.span.attempt(
            base_url=replica.base_url,
            upstream_model=target.upstream_model,
            backend=pool.name,
            replica=replica.name,
            hedge=is_hedge,
            provider=None if provider is None else pool.settings.kind,
        )
        call.tried = (pool.name, replica.name)
        headers = call.headers.copy()
        headers.update(pool.auth_headers() if provider is None else provider.headers)
        if provider is None and call.plan.name != "default" and "priority" not in call.parsed.body:
            # The surface's priority for replicas started with --scheduling-policy priority
            # (others ignore it); a client's own `priority` field is left to win.
            headers["X-Vllm-Priority"] = str(VLLM_PRIORITY[call.plan.priority])
        span.inject(headers)
        path = call.parsed.endpoint.value if provider is None else provider.path
        timeouts = target.timeouts
        first_byte_s = timeouts.first_byte_s
        if call.deadline is not None:
            first_byte_s = min(first_byte_s, max(call.deadline - time.perf_counter(), 0.001))
        # A wait cut short by the surface's deadline says nothing of the replica's health.
        ours = first_byte_s < timeouts.first_byte_s
        # Under the surface's deadline a stream's head is not its answer begun (vLLM sends the
        # head at once, the first chunk with the first token): the client's 200 waits for the
        # first chunk, and none by the deadline is a 504, as no head by then is.
        read_first = read_first or (call.deadline is not None and call.parsed.stream)
        guard = LoadGuard(replica)
        opened_at = time.perf_counter()
        response: UpstreamResponse | None = None
        try:
            response = await open_upstream(
                pool, replica, UpstreamRequest(path, body, headers), timeouts, first_byte_s
            )
            self.limits.observe(replica.base_url, response.headers, response.status)
            translated = False  # a stream (SSE) a provider translates
            if provider is not None:
                # Providers' backends are never vLLM's: their requests go through aiohttp.
                assert isinstance(response, aiohttp.ClientResponse)
                raw, response = response, provider.wrap(response, call.parsed)
                translated = response is not raw and _sse(response)
            if call.parsed.stream and response.status == 200:
                _check_streams(response, replica)
            attempt = Attempt(target, decision, response, guard, span, timeouts, opened_at)
            attempt.capped = capped
            attempt.metrics = self.metrics
            # A translated stream is read to its first chunk (Anthropic's message_start) before
            # anything goes out: an error event before it (overloaded) is retried elsewhere.
            if (read_first or translated) and response.status == 200:
                if call.deadline is not None:  # what is left of it, the head's wait spent
                    left = max(call.deadline - time.perf_counter(), 0.001)
                    if left < first_byte_s:  # the deadline cuts this wait: not the replica's
                        first_byte_s, ours = left, True
                attempt.first = await _first_chunk(response, replica, first_byte_s)
                attempt.first_at = time.perf_counter()
                span.first_chunk()
        except AttemptFailed as exc:
            if response is not None:
                response.close()
            guard.release()
            span.end(exc.outcome, None if response is None else response.status)
            self.metrics.attempt(pool.name, replica.name, exc.outcome)
            # A refused key, a wait for one of the gateway's own connections, or a time-out the
            # caller's deadline set says nothing of its health.
            if exc.outcome not in _NOT_ITS_HEALTH and not (ours and exc.outcome == "timeout"):
                model = None if exc.outcome == "connect_error" else target.upstream_model
                replica.record_failure(str(exc), model)
            raise
        except BaseException:  # cancelled (client gone, or a hedge lost) before it was handed on
            if response is not None:
                response.close()
            guard.release()
            # Counted as its span ends it (``cancelled``), and never against the replica's health.
            span.end("cancelled")
            self.metrics.attempt(pool.name, replica.name, "cancelled")
            raise
        # A 4xx, a 429 included, is the request's or the account's, never the replica's failure;
        # success is recorded, and the attempt counted, when the answer ends (``Attempt.finish``).
        call.leases.add(attempt)  # open: its owner finishes it (else the request's end does)
        return attempt


_NOT_ITS_HEALTH = frozenset(("rejected_key", "no_connection"))


def _has_room(replica: Replica, pool: BackendPool) -> bool:
    """A connection of the gateway's to ``replica`` is free (each attempt holds at most one)."""
    return replica.outstanding < pool.settings.max_connections


def _sse(response: UpstreamResponse) -> bool:
    return "event-stream" in response.headers.get("Content-Type", "").lower()


def _check_streams(response: UpstreamResponse, replica: Replica) -> None:
    """A stream request's 200 must be SSE, or a whole JSON answer (a server that ignores
    ``stream``: the relay sends it as a stream); anything else (a proxy's HTML page) is no
    answer, and another replica may give one: nothing went to the client yet."""
    ctype = response.headers.get("Content-Type")
    if ctype is None or "event-stream" in ctype.lower() or "json" in ctype.lower():
        return
    raise AttemptFailed(
        "bad_answer", f"{replica.name} answered a stream request with {ctype[:80]!r}", True
    )


async def _first_chunk(response: UpstreamResponse, replica: Replica, limit_s: float) -> bytes:
    """Read until the first bytes of the body (a hedge races on this, not on the headers)."""
    try:
        async with asyncio.timeout(limit_s):
            data = await response.content.readany()
    except TimeoutError as exc:
        raise AttemptFailed("timeout", f"{replica.name} sent no token in time", False) from exc
    except UpstreamStreamError as exc:  # an error event first: as the same error in a status
        raise AttemptFailed("http_5xx", f"{replica.name} answered {exc}", True) from exc
    except aiohttp.ClientError as exc:
        raise AttemptFailed("connect_error", f"{replica.name} broke the stream", True) from exc
    if not data:
        raise AttemptFailed("connect_error", f"{replica.name} ended the stream at once", True)
    return data


def _tokens(call: Call) -> int:
    """What the request may use of a provider's token budget (its reservation's estimate)."""
    expected = call.rt.limits.expected_output(call.plan.name)
    generates = call.parsed.endpoint is not Endpoint.EMBEDDINGS
    return reserve_tokens(call.parsed.body, expected, generates)
