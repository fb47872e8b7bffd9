"""The limits stage: a tenant's limits and budget before the request runs; its usage, cost and
settlement after.

Before: one limiter call takes every limit that binds the request (``gateway.limits``),
reserving its estimated tokens (``gateway.limits.estimate``) and, under a budget, holding the
most its answer may cost: the prompt's estimate and the output reservation (``max_tokens`` x
``n``, else the expected output) at the costliest target that may answer it (any fallback; a
tiered alias's dearer tier, or both tiers' sum for a cascade, whose escalated small answer is
paid for too). The hold is released when the request settles. A refusal is a 429 as OpenAI
sends it (``rate_limit_exceeded``; ``insufficient_quota`` for a budget that cannot cover the
request) with ``Retry-After``; the ``x-ratelimit-*`` headers go on every response of a
limited tenant. A budget that cannot cover it with ``on_exhausted: downgrade`` is served by
the model the budget names (``downgrade_to``), else by the alias's small tier, holding
nothing, and says so (``x-gateway-downgraded``); with neither, it is refused as a spent budget.

After: the answer's usage (its JSON, its stream's usage chunk, zero for a cache hit) is priced
by the destination that answered (``models.<alias>.price``): in ``x-gateway-cost-usd`` while
headers can still be sent (JSON answers, cached and held answers; a live stream's headers left
before its usage was known), on the span (``gateway.cost.usd``), in the metrics per tenant,
surface and model, and settled by the limiter in the background. An upstream that reports no
usage, or a malformed or incomplete one (``Usage.read``), is charged the estimate. A request that failed before an upstream answered gives its
tokens back; one that failed after (too large, a time-out while its body came: the upstream
generated it) is charged its usage if read, else its estimate (``Quota.failed``). One whose
client left is charged its prompt estimate (a Messages stream's input as its ``message_start``
counted it: its output is unknown until ``message_delta``) and the stream events it was sent,
priced as the first target's until an attempt opened.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

from gateway.call import STATUS_KEY, Call
from gateway.errors import GatewayError, QuotaExceeded, RateLimited, Unavailable
from gateway.limits.check import LimitExceeded
from gateway.limits.cost import Price, Usage, cost_pico, most_cost, usd_float, usd_text
from gateway.limits.estimate import output_tokens, prompt_tokens
from gateway.limits.limiter import Admission
from gateway.limits.rules import RateLimits
from gateway.limits.usage import UsageRecord
from gateway.observability.usage_metrics import UsageMetrics
from gateway.protocol.openai import Endpoint
from gateway.protocol.usage import UsageTap, usage_in
from gateway.runtime import Destination, Runtime
from gateway.upstream.attempt import Attempt


@dataclass(slots=True)
class Quota:
    """One request's admission, and what its answer used as it went out."""

    call: Call
    admission: Admission
    targets: list[Destination]  # the downgraded ones when the budget is spent
    downgraded: str | None = None  # what serves instead: "small" or an alias
    reserved: int = 0  # tokens taken from tokens_per_minute
    # Of the destination that answered; until one does, of the first target (a client that
    # leaves before the headers is charged its prompt's estimate at that price).
    price: Price | None = None
    answered: bool = False  # an upstream began an answer (2xx headers): something was generated
    cache_hit: bool = False
    tap: UsageTap | None = None  # a live stream's usage chunk
    answer_usage: Usage | None = None  # a whole answer's usage (its usage object alone)
    spent: list[tuple[Usage, Price | None]] = field(default_factory=list)  # answers not served

    def headers(self) -> dict[str, str]:
        headers = self.admission.headers()
        if self.downgraded is not None:
            headers["x-gateway-downgraded"] = self.downgraded
        return headers

    def usage(self) -> Usage | None:
        if self.cache_hit:
            return Usage()
        if self.answer_usage is not None:
            return self.answer_usage
        return self.tap.usage if self.tap is not None else None

    def estimate(self, left: bool = False) -> Usage:
        """What the answer used when the upstream did not say: the prompt's estimate (a
        Messages stream's input as its ``message_start`` counted it), and for the output what a
        stream sent (an event is about a token), nothing for an answer its client left (the
        upstream was closed), else its cap (``max_tokens`` or the expectation)."""
        call = self.call
        if self.tap is not None and (told := self.tap.prompt) is not None:
            return Usage(told.input, told.cached_input, self.tap.events)
        prompt = prompt_tokens(call.parsed.body)
        if self.tap is not None:
            return Usage(input=prompt, output=self.tap.events)
        if left or call.parsed.endpoint is Endpoint.EMBEDDINGS:
            return Usage(input=prompt)
        expected = call.rt.limits.expected_output(call.plan.name)
        return Usage(input=prompt, output=output_tokens(call.parsed.body, expected))

    def estimate_json(self) -> dict[str, int]:
        """``estimate`` as chat's usage object (a stream the deadline stopped tells it)."""
        usage = self.estimate()
        return {
            "prompt_tokens": usage.input,
            "completion_tokens": usage.output,
            "total_tokens": usage.total,
        }

    def opened(self, attempt: Attempt) -> None:
        """The attempt that answers: its price, and whether it began an answer."""
        self.price = attempt.target.price
        self.answered = 200 <= attempt.response.status < 300

    def failed(self, exc: GatewayError) -> Usage | None:
        """What a request the gateway failed used. Nothing before an upstream answered (a
        connect error, a 5xx or 4xx, no replica: the reservation is given back). After, the
        answer was generated (a provider bills it): its usage if it was read, else the
        estimate, whole for an answer refused as too large, the prompt's for one cut short
        (a time-out, a broken body), as a broken stream is charged its prompt and its events."""
        if not self.answered:
            return None
        return self.usage() or self.estimate(left=exc.code != "response_too_large")

    def cost(self, usage: Usage | None) -> int | None:
        """pUSD of the answer and of what was paid for on the way; None if nothing is priced."""
        parts = [(usage, self.price), *self.spent]
        priced = [(u, p) for u, p in parts if u is not None and p is not None]
        if self.cache_hit:
            return 0
        return sum(cost_pico(p, u) for u, p in priced) if priced else None

    def on_answer(self, body: bytes, attempt: Attempt | None) -> Mapping[str, str]:
        """A whole answer before its headers go: read its usage, say its cost."""
        if attempt is not None:
            self.opened(attempt)
        if not self.cache_hit:
            self.answer_usage = Usage.read(usage_in(body))
        cost = self.cost(self.usage() or self.estimate())
        return {} if cost is None else {"x-gateway-cost-usd": usd_text(cost)}


class Limited:
    """The limits around one request (a class, not a generator: one less frame and object)."""

    __slots__ = ("call", "quota", "stage", "targets")

    def __init__(self, stage: LimitStage, call: Call, targets: list[Destination]) -> None:
        self.stage = stage
        self.call = call
        self.targets = targets
        self.quota: Quota | None = None

    async def __aenter__(self) -> Quota:
        self.quota = await self.stage.admit(self.call, self.targets)
        return self.quota

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        quota, stage, call = self.quota, self.stage, self.call
        if quota is None:
            return
        if isinstance(exc, GatewayError):
            exc.headers.update(quota.admission.headers())
            stage.settle(call, quota, quota.failed(exc), estimated=quota.usage() is None)
        elif isinstance(exc, asyncio.CancelledError):
            usage = quota.usage()
            stage.settle(call, quota, usage or quota.estimate(left=True), estimated=usage is None)
        else:
            stage.settle(call, quota, stage.used(call, quota))


class LimitStage:
    def __init__(self, metrics: UsageMetrics) -> None:
        self.metrics = metrics

    def limited(self, call: Call, targets: list[Destination]) -> Limited:
        """``async with``: admit ``call`` (or raise a 429/503); settle what it used at the end."""
        return Limited(self, call, targets)

    async def admit(self, call: Call, targets: list[Destination]) -> Quota:
        rt, parsed = call.rt, call.parsed
        subject = rt.limits.subject(call.tenant, call.plan.name)
        tokens = cost = 0
        counts = _counts_tokens(subject.limits) or _counts_tokens(subject.surface_limits)
        if counts or subject.budget is not None:
            prompt = prompt_tokens(parsed.body)
            output = 0
            if parsed.endpoint is not Endpoint.EMBEDDINGS:  # passthroughs generate too
                output = output_tokens(parsed.body, rt.limits.expected_output(call.plan.name))
            tokens = prompt + output if counts else 0
            if subject.budget is not None:
                cost = _most_cost(call, targets, prompt, output)
        try:
            admission = await rt.limiter.admit(subject, tokens, cost)
        except LimitExceeded as exc:
            self.metrics.refusal(call.tenant, call.plan.name, exc.reason)
            call.span.decision({"limits.refused": exc.reason})
            raise _error(exc) from exc
        quota = Quota(call, admission, targets, reserved=tokens)
        if admission.downgrade:
            try:
                quota.targets, quota.downgraded = _downgrade(call)
            except QuotaExceeded as exc:
                rt.limiter.finish(admission, None)
                self.metrics.refusal(call.tenant, call.plan.name, "budget")
                exc.headers.update(admission.headers())
                raise
            self.metrics.downgrades.labels(call.tenant, call.plan.name).inc()
            call.span.decision({"limits.downgraded": quota.downgraded})
        if admission.degraded:
            call.span.decision({"limits.degraded": True})
        if quota.targets:
            quota.price = quota.targets[0].price  # until an attempt opens (``Quota.opened``)
        return quota

    async def admit_request(self, rt: Runtime, tenant: str, surface: str) -> Admission:
        """A request that generates nothing (a token count): the tenant's request and
        concurrency limits only, no tokens, no budget (it costs nothing); ``finish`` it with
        no record."""
        subject = dataclasses.replace(rt.limits.subject(tenant, surface), budget=None)
        try:
            return await rt.limiter.admit(subject, 0)
        except LimitExceeded as exc:
            self.metrics.refusal(tenant, surface, exc.reason)
            raise _error(exc) from exc

    def used(self, call: Call, quota: Quota) -> Usage | None:
        """What an answer used: reported, else estimated; None when nothing was generated."""
        usage = quota.usage()
        if usage is not None:
            return usage
        if quota.tap is not None and quota.tap.events:
            return quota.estimate()  # a stream that ended without its usage
        if call.request.get(STATUS_KEY, 200) >= 400 and not quota.answered:
            return None  # the upstream refused (4xx): nothing was generated
        return quota.estimate()

    def settle(
        self, call: Call, quota: Quota, usage: Usage | None, estimated: bool = False
    ) -> None:
        record = None
        tokens = _with_spent(usage, quota)  # counted as they are charged
        if tokens is not None:
            cost = quota.cost(usage)
            model = call.parsed.model
            record = UsageRecord(call.plan.name, model, tokens, cost or 0, quota.cache_hit)
            self.metrics.answered(call.tenant, call.plan.name, model, tokens, cost, quota.cache_hit)
            if cost is not None:
                call.span.decision({"cost.usd": usd_float(cost)})
            call.span.decision(
                {
                    "usage.cached_input_tokens": tokens.cached_input,
                    "usage.estimated": (estimated and usage is not None) or None,
                }
            )
        call.rt.limiter.finish(quota.admission, record)


def _with_spent(usage: Usage | None, quota: Quota) -> Usage | None:
    """The answer's tokens plus those of answers paid for and not served (an escalated small
    tier's); None when there is neither."""
    parts = [u for u in (usage, *(spent for spent, _ in quota.spent)) if u is not None]
    if not parts or (usage is not None and len(parts) == 1):
        return usage
    return Usage(
        input=sum(u.input for u in parts),
        cached_input=sum(u.cached_input for u in parts),
        output=sum(u.output for u in parts),
    )


def _most_cost(call: Call, targets: list[Destination], prompt: int, output: int) -> int:
    """The most the answer may cost (pUSD), priced at the costliest target that may serve it:
    any of the alias's fallbacks; for a tiered alias the dearer tier (the targets given are
    its small tier's), or both tiers for a cascade (an escalated small answer is paid too)."""

    def at(targets: list[Destination]) -> int:
        priced = (most_cost(t.price, prompt, output) for t in targets if t.price is not None)
        return max(priced, default=0)

    rt, alias = call.rt, call.parsed.model
    tiered = rt.tiered(alias)
    if tiered is None:
        return at(targets)
    each = [at(rt.tier_targets(alias, tier)) for tier in tiered.tiers]
    return sum(each) if tiered.mode == "cascade" else max(each)


def _counts_tokens(limits: RateLimits | None) -> bool:
    return limits is not None and limits.tokens_per_minute is not None


def _error(exc: LimitExceeded) -> GatewayError:
    if exc.reason == "budget":
        return QuotaExceeded(exc.message, code="insufficient_quota", headers=exc.headers)
    if exc.reason == "unavailable":
        return Unavailable(exc.message, code="limits_unavailable", headers=exc.headers)
    return RateLimited(exc.message, code="rate_limit_exceeded", headers=exc.headers)


def _downgrade(call: Call) -> tuple[list[Destination], str]:
    """The budget is spent: the model the budget names, else the alias's small tier; of its
    destinations, those that serve the request's endpoint (a passthrough, the client's own
    Responses or Messages request, only a backend that serves that API itself), else refused
    as spent."""
    rt, alias, endpoint = call.rt, call.parsed.model, call.parsed.endpoint
    named = rt.limits.downgrade_to(call.tenant)
    if named is not None:
        tiered = rt.tiered(named)
        targets = rt.tier_targets(named, tiered.small) if tiered else rt.targets(named)
        downgraded = named
    elif (tiered := rt.tiered(alias)) is not None:
        targets, downgraded = rt.tier_targets(alias, tiered.small), "small"
    else:
        raise QuotaExceeded(
            f"tenant {call.tenant!r} has spent its budget and model '{alias}' has no cheaper tier",
            code="insufficient_quota",
        )
    targets = rt.serving(targets, endpoint)
    if not targets:
        api = endpoint.value.capitalize()
        raise QuotaExceeded(
            f"tenant {call.tenant!r} has spent its budget, and its downgrade ('{downgraded}') "
            f"has no backend that serves the {api} API itself, as model '{alias}' does",
            code="insufficient_quota",
        )
    return targets, downgraded
