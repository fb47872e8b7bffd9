"""After an answer: what it tells the metrics, the latency tracker, the surface's SLO and the
request's span (a cache hit's too: ``Recorder.cached``); and the outcome of a request however
it ends (``Recorder.outcome``). The span names the answer its client got: a stream the
deadline stopped ends ``length`` with the usage charged, a re-told answer has the dialect's id.

A stream is read as it goes by the ``Watch`` the relay feeds (the span's summary, the cache's
capture); a whole answer traced is summarised when its span is encoded (after the answer went
out, with a chunk of other spans) when it is small (``LAZY_BODY_MAX``), here otherwise. With
the policy's ``telemetry.record_content`` the span also gets the prompt and the answer's text
(the stream's summary collects it; a whole answer is read here).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

from gateway.call import STATUS_KEY, Call
from gateway.errors import GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import RequestTiming, SloTracker
from gateway.observability.summary import ResponseSummary, StreamSummarizer, summarize_body
from gateway.observability.tracing import RequestSpan, body_attributes, hit_attributes
from gateway.stages.cache import Lookup, StreamCapture
from gateway.upstream.relay import Relayed
from routing.latency import queue_of

# A traced answer up to this size is kept until its span is exported and parsed there.
LAZY_BODY_MAX = 64 * 1024


class Recorder:
    def __init__(self, metrics: GatewayMetrics, slo: SloTracker) -> None:
        self.metrics = metrics
        self.slo = slo

    def cached(self, call: Call, answer: bytes) -> None:
        """A cache hit's span: the answer as replayed (the stored model and finish, the id its
        client got, no tokens, no upstream's id), and the cache as the replica that served it."""
        call.span.response_later(hit_attributes(answer, _client_id(call)))
        if call.span.keeps_decisions:
            call.span.decision({"replica": "cache"})

    def outcome(self, call: Call) -> Outcome:
        """Ends the request's span with its status; a failure counts against the surface's SLO."""
        return Outcome(call, self.slo)

    def record(self, call: Call, served: Served) -> None:
        """Latency per replica, the surface's SLO and budget breaches, the span's response."""
        result, attempt = served.relayed.result, served.relayed.attempt
        assert attempt is not None  # live or held answers come from an attempt
        span, plan, model = call.span, call.plan, call.parsed.model
        replica = attempt.decision.replica
        key = replica.base_url
        ttft_ms = None
        if result.first_at is not None:
            ttft_ms = (result.first_at - call.started) * 1000
            pool_name = attempt.target.pool.name
            self.metrics.ttft_child(model, pool_name, replica.name).observe(ttft_ms / 1000)
            if result.live:  # a held answer's first chunk says nothing of the replica's TTFT
                call.rt.latency.observe_ttft(
                    key, (result.first_at - attempt.opened_at) * 1000, queue=queue_of(replica)
                )
            span.first_token(ttft_ms)
        itl_ms = result.mean_gap_ms()
        if itl_ms is not None:
            call.rt.latency.observe_itl(key, itl_ms)
        summary: ResponseSummary | None = None
        told = _client_id(call)
        if result.body is not None and span.recording:
            content = span.records_content  # the text is read now, with the rest
            if len(result.body) <= LAZY_BODY_MAX and not content:  # parsed when encoded
                span.response_later(body_attributes(result.body, told), key)
            else:  # the export queue must not hold large answers
                summary = summarize_body(result.body, content)
                _span_response(span, summary, key, told)
        elif served.watch.summary is not None:
            summary = served.watch.summary.summary
            if result.deadline_hit:
                summary.stopped(result.stop_usage)
            _span_response(span, summary, key, told)
        if summary is not None and span.records_content:  # the policy's record_content
            span.content(input_messages(call.parsed.body), summary.output_messages())
        if result.deadline_hit:
            self.metrics.deadlines.labels(plan.name).inc()
        if span.keeps_decisions:
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
        timing = RequestTiming(ms_since(call.started), ttft_ms, itl_ms, ok=result.status < 500)
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


class Outcome:
    """``with orchestrator.outcome(call) as done``: a plain context manager (its exit does no
    I/O), so no generator or coroutine is made for it on every request."""

    __slots__ = ("call", "failed_as", "slo", "status")

    def __init__(self, call: Call, slo: SloTracker) -> None:
        self.call = call
        self.slo = slo
        self.status = 500
        self.failed_as: str | None = None  # how the replica failed an answer already begun

    def __enter__(self) -> Callable[[Relayed], web.StreamResponse]:
        return self.done

    def done(self, served: Relayed) -> web.StreamResponse:
        self.status = served.result.status
        self.call.request[STATUS_KEY] = self.status
        attempt = served.attempt
        if attempt is not None and attempt.failure is not None:
            self.failed_as = attempt.failed_as
        return served.response

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        call, error_type = self.call, None
        if isinstance(exc, GatewayError):
            self.status = exc.status
            if exc.status >= 500:  # a client's error (4xx) is not the server span's error
                error_type = exc.code or exc.type
        elif isinstance(exc, asyncio.CancelledError):
            self.status = 499  # the client went away: not the server's failure
        elif isinstance(exc, ConnectionError):  # the client went away while its answer was written
            transport = call.request.transport
            if transport is None or transport.is_closing():
                self.status = 499
        status = self.status
        if status >= 500 and status != 499:
            if STATUS_KEY not in call.request:
                self.slo.observe(call.plan.name, RequestTiming(ms_since(call.started), ok=False))
            elif error_type is None:  # answered, then failed (a stream cut): say how
                error_type = self.failed_as or str(status)
        call.span.end(status, error_type)


@dataclass(slots=True)
class Watch:
    """Who reads a streamed answer as it is sent: the span's summary, the cache's capture."""

    summary: StreamSummarizer | None = None
    capture: StreamCapture | None = None

    @classmethod
    def of(cls, call: Call, lookup: Lookup) -> Watch:
        if not call.parsed.stream:
            return cls()
        return cls(
            StreamSummarizer(call.span.records_content) if call.span.recording else None,
            StreamCapture() if lookup.fills else None,
        )

    def feeders(self) -> tuple[Callable[[bytes], None], ...]:
        return tuple(w.feed for w in (self.summary, self.capture) if w is not None)


@dataclass(slots=True)
class Served:
    relayed: Relayed
    watch: Watch
    # Not what the request resolves to, for this request alone: a fallback backend's answer,
    # or a cascade's small answer served because the large tier failed. Never stored.
    degraded: bool = False


def _span_response(
    span: RequestSpan, summary: ResponseSummary, server_url: str, client_id: str | None
) -> None:
    span.response(
        model=summary.model,
        response_id=summary.response_id,
        input_tokens=summary.input_tokens,
        output_tokens=summary.output_tokens,
        finish_reasons=summary.finish_reasons,
        server_url=server_url,
        client_id=client_id,
    )


def _client_id(call: Call) -> str | None:
    """The id of the answer its client got, when not the upstream's (``Dialect.answer_id``)."""
    return call.dialect.answer_id if call.dialect is not None else None


def input_messages(body: Mapping[str, Any]) -> str | None:
    """The request's prompt as ``gen_ai.input.messages`` (JSON): a chat request's messages as
    the caller sent them (a dialect's, translated to chat), else its prompt or input as one
    user message (a Responses list of input items as they are). A request relayed untranslated
    keeps its system prompt apart (Anthropic's ``system``, the Responses ``instructions``): it
    comes first, as a system message."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = None
        for field in ("prompt", "input"):
            value = body.get(field)
            if isinstance(value, list) and field == "input":
                messages = value
                break
            if value is not None:
                messages = [{"role": "user", "content": value}]
                break
    if messages is None:
        return None
    system = body.get("system", body.get("instructions"))
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    return json.dumps(messages, ensure_ascii=False)


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000
