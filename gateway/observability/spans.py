"""A request's spans on the event loop: plain records, OTLP encoded later in chunks of them.

What a request's trace holds is what the OpenTelemetry SDK path recorded (GenAI conventions
for the request and each upstream attempt, ``gateway.*`` decision attributes, stage spans,
``first_token`` and ``budget_breach`` events, W3C trace context in and out), but the event loop
does none of the SDK's work: no span objects with locks, no attribute validation, no context
objects. A span here is a small slotted object collecting references (the decision dicts the
orchestrator already built, unformatted); at its end it becomes one ``SpanRecord`` tuple
appended to the exporter's queue (``gateway.observability.otlp``), which merges the attributes
and encodes OTLP protobuf a chunk of records at a time, later, and sends it from its thread.
Which requests get a recording span, and the failure traces kept of the others
(``DeferredRequestSpan``), is the tracer's choice: ``gateway.observability.sampling``. The
attribute names and the mappings made of them: ``gateway.observability.span_attributes``.

Times. The request's span starts when the request arrived (``Call.started``, before its body
was read: what OpenTelemetry asks of a server span), and ``gateway.ttft_ms`` (the client's
time to first token, upload included) is measured from the same instant, so the
``first_token`` event sits at ``start + ttft`` inside the span. Attempts are numbered in the
order they were opened (``gateway.attempt.index``: retries, hedges and a cascade's tiers). The
span carries the gateway's request id (``gateway.request.id``, the ``x-request-id`` answered).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gateway.observability.span_attributes import (
    INPUT_MESSAGES,
    OPERATION,
    OUTPUT_MESSAGES,
    REQUEST_ID,
    REQUEST_MODEL,
    attempt_attributes,
    capped,
    capped_content,
    response_attributes,
    server_attributes,
)
from gateway.observability.span_records import (
    CONSTANT,
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    LAZY,
    STATUS_ERROR,
    STATUS_UNSET,
    AttrGroup,
    Event,
)

if TYPE_CHECKING:
    from gateway.observability.sampling import Tracer

_GATEWAY = "gateway."
# An attempt's outcomes that are the replica's (or the gateway's) failure: the span's status is
# ERROR and error.type the outcome. A 4xx is the caller's or the account's: not the attempt's.
_FAILED_OUTCOMES = frozenset(("http_5xx", "connect_error", "timeout", "bad_status", "rejected_key",
                              "bad_answer", "idle_timeout", "answer_broken", "stream_error", "no_connection",
                              "abandoned"))  # fmt: skip
_time_ns = time.time_ns
_bits = random.getrandbits


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class RequestSpan:
    """One request's span and the helpers that hang stages, attempts and decisions on it."""

    __slots__ = ("attempt_count", "ended", "events", "groups", "keeps_decisions", "name",
                 "operation", "parent_id", "recording", "span_id", "start_ns", "trace_id",
                 "trace_state", "tracer")  # fmt: skip

    def __init__(
        self,
        tracer: Tracer | None,
        operation: str,
        name: str = "",
        trace_id: int = 0,
        parent_id: int = 0,
        trace_state: str = "",
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tracer = tracer
        self.operation = operation
        self.recording = tracer is not None
        # Whether decision() keeps anything: callers skip building the mapping otherwise.
        self.keeps_decisions = self.recording
        self.name = name
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.span_id = _bits(64) or 1
        self.trace_state = trace_state
        self.start_ns = _time_ns()
        self.groups: list[AttrGroup] = [("", attrs)] if attrs is not None else []
        self.events: list[Event] = []
        self.ended = False
        self.attempt_count = 0

    def decision(self, attrs: Mapping[str, Any]) -> None:
        """``gateway.<key>`` for each key (None values are skipped, at encoding)."""
        if self.recording:
            self.groups.append((_GATEWAY, attrs))

    def child(self, name: str, attrs: Mapping[str, Any] | None = None) -> StageSpan:
        """A stage span (``gateway.cache.lookup``...): ``with span.child(name) as stage: ...``."""
        if not self.recording:
            return NOOP_STAGE
        return StageSpan(self, name, attrs)

    def attempt(
        self,
        *,
        base_url: str,
        upstream_model: str,
        backend: str,
        replica: str,
        hedge: bool = False,
        provider: str | None = None,
    ) -> AttemptSpan:
        """A CLIENT span for one upstream attempt (numbered in the order they are opened); end
        it with ``AttemptSpan.end``."""
        if not self.recording:
            return NOOP_ATTEMPT
        index = self.attempt_count
        self.attempt_count = index + 1
        attrs = attempt_attributes(
            self.operation, base_url, upstream_model, backend, replica, hedge, index, provider
        )
        return AttemptSpan(self, f"{self.operation} {upstream_model}", attrs)

    def first_token(self, ttft_ms: float) -> None:
        """The ``first_token`` event, at ``ttft_ms`` after the span's start (the request's
        arrival), whenever it is recorded (the answer's end)."""
        if self.recording:
            at_ns = self.start_ns + int(ttft_ms * 1_000_000)
            self.events.append((at_ns, "first_token", {"gateway.ttft_ms": ttft_ms}))

    def budget_breach(self, kind: str, budget_ms: float, observed_ms: float) -> None:
        """``kind``: ttft | itl | total | queue."""
        if self.recording:
            self.events.append((_time_ns(), "budget_breach", _breach(kind, budget_ms, observed_ms)))

    def response(
        self,
        *,
        model: str | None = None,
        response_id: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        server_url: str | None = None,
        client_id: str | None = None,
    ) -> None:
        """The answer's attributes; ``client_id``: the id its client got, when not the
        upstream's ``response_id``."""
        if not self.recording:
            return
        self.groups.append(
            ("", response_attributes(model, response_id, input_tokens, output_tokens,
                                     finish_reasons, client_id))
        )  # fmt: skip
        if server_url is not None:
            self.groups.append((CONSTANT, server_attributes(server_url)))

    def response_later(self, attributes: tuple[str, Any], server_url: str | None = None) -> None:
        """Response attributes made when the span is encoded: ``attributes`` is (the name of a
        function registered with ``span_records.lazy``, its argument), e.g. the answer's bytes (the loop
        does not parse them a second time for the span)."""
        if self.recording:
            self.groups.append((LAZY, attributes))
            if server_url is not None:
                self.groups.append((CONSTANT, server_attributes(server_url)))

    @property
    def records_content(self) -> bool:
        """Whether ``content`` keeps anything (the policy's ``telemetry.record_content``):
        callers collect the answer's text only then."""
        return self.recording and self.tracer is not None and self.tracer.record_content

    def content(self, input_messages_json: str | None, output_messages_json: str | None) -> None:
        """Prompt and completion (JSON, GenAI message shape): only when the policy opts in;
        each cut to ``MAX_CONTENT_CHARS``."""
        if self.records_content:
            self.groups.append(
                ("", {INPUT_MESSAGES: capped_content(input_messages_json),
                      OUTPUT_MESSAGES: capped_content(output_messages_json)})
            )  # fmt: skip

    def end(self, status: int, error_type: str | None = None) -> None:
        if not self.recording or self.ended or self.tracer is None:
            return
        self.ended = True
        self.tracer.open -= 1
        self._record(status, error_type)

    def _record(self, status: int, error_type: str | None) -> None:
        tracer = self.tracer
        if tracer is None or tracer.sink is None:
            return
        self.groups.append(("", {"http.response.status_code": status, "error.type": error_type}))
        failed = status >= 500 or error_type is not None
        tracer.sink.add(
            (self.trace_id, self.span_id, self.parent_id, self.name, KIND_SERVER, self.start_ns,
             _time_ns(), tuple(self.groups), tuple(self.events),
             STATUS_ERROR if failed else STATUS_UNSET, error_type or "", self.trace_state)
        )  # fmt: skip


class StageSpan:
    """An INTERNAL child span around a stage; ended when its ``with`` block exits."""

    __slots__ = ("attrs", "name", "request", "start_ns")

    def __init__(self, request: RequestSpan | None, name: str, attrs: Mapping[str, Any] | None):
        self.request = request
        self.name = name
        self.attrs: dict[str, Any] = dict(attrs) if attrs else {}
        self.start_ns = 0

    def set_attribute(self, key: str, value: Any) -> None:
        if self.request is not None:
            self.attrs[key] = value

    def __enter__(self) -> StageSpan:
        self.start_ns = _time_ns()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        rs = self.request
        if rs is None or rs.tracer is None or rs.tracer.sink is None:
            return
        status = STATUS_ERROR if exc is not None else STATUS_UNSET
        if exc is not None:
            self.attrs["error.type"] = type(exc).__qualname__
        rs.tracer.sink.add(
            (rs.trace_id, _bits(64) or 1, rs.span_id, self.name, KIND_INTERNAL, self.start_ns,
             _time_ns(), (("", self.attrs),), (), status, "", rs.trace_state)
        )  # fmt: skip


class AttemptSpan:
    __slots__ = ("attrs", "chunk_ns", "end_ns", "name", "outcome", "recording", "request",
                 "span_id", "start_ns", "status")  # fmt: skip

    def __init__(self, request: RequestSpan | None, name: str, attrs: Mapping[str, Any]) -> None:
        self.request = request
        self.recording = request is not None
        self.name = name
        self.attrs = attrs
        self.span_id = _bits(64) or 1
        self.start_ns = _time_ns()
        self.chunk_ns: int | None = None
        self.end_ns: int | None = None
        self.outcome = "cancelled"  # unless ended otherwise before the request
        self.status: int | None = None

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Write this attempt's ``traceparent`` (and the caller's ``tracestate``) upstream."""
        rs = self.request
        if self.recording and rs is not None:
            headers["traceparent"] = traceparent(rs.trace_id, self.span_id)
            if rs.trace_state:
                headers["tracestate"] = rs.trace_state

    def first_chunk(self) -> None:
        if self.request is not None and self.chunk_ns is None:
            self.chunk_ns = _time_ns()

    def end(self, outcome: str, status: int | None = None, end_ns: int | None = None) -> None:
        """``outcome`` (as ``llm_gateway_upstream_attempts_total`` counts it, won as ok):
        ok | won (a hedged request's answer) | lost (a losing hedge, an escalated cascade's small
        answer) | cancelled (before its headers) | incomplete (ended by the client or a limit
        of ours) | http_4xx | http_429 | before its headers: http_5xx | connect_error | timeout
        | bad_status | rejected_key | bad_answer (also: a 200 that is no answer, read later) |
        after them: idle_timeout | answer_broken (the connection broke, or the stream ended
        before its end) | stream_error (the upstream's error event) | abandoned (left open by
        its owner, released at the request's end: a gateway bug). ``end_ns``: when it ended,
        if before now (wall clock)."""
        if self.request is None or self.end_ns is not None:
            return
        self.end_ns = _time_ns() if end_ns is None else end_ns
        self.outcome = outcome
        self.status = status
        if self.recording:
            self.emit(self.request, self.request.trace_id, self.request.span_id, self.end_ns)

    def emit(self, rs: RequestSpan, trace_id: int, parent_id: int, end_ns: int) -> None:
        tracer = rs.tracer
        if tracer is None or tracer.sink is None:
            return
        failed = self.outcome in _FAILED_OUTCOMES
        outcome = {"gateway.attempt.outcome": self.outcome, "http.response.status_code":
                   self.status, "error.type": self.outcome if failed else None}  # fmt: skip
        events: tuple[Event, ...] = (
            () if self.chunk_ns is None else ((self.chunk_ns, "first_chunk", None),)
        )
        tracer.sink.add(
            (trace_id, self.span_id, parent_id, self.name, KIND_CLIENT, self.start_ns,
             self.end_ns or end_ns, ((CONSTANT, self.attrs), ("", outcome)), events,
             STATUS_ERROR if failed else STATUS_UNSET, self.outcome if failed else "",
             rs.trace_state)
        )  # fmt: skip


class DeferredRequestSpan(RequestSpan):
    """An unsampled request's span-to-be: recorded only if the request fails
    (``gateway.observability.sampling``)."""

    __slots__ = ("arrived", "attempts")

    def __init__(
        self,
        tracer: Tracer,
        operation: str,
        request_model: str,
        request_id: str = "",
        arrived: float | None = None,
    ) -> None:
        # Not RequestSpan.__init__: a few stores, no ids.
        self.tracer = tracer
        self.operation = operation
        self.recording = False
        self.keeps_decisions = True
        model = capped(request_model)
        self.name = f"{operation} {model}"
        self.start_ns = _time_ns()
        self.trace_state = ""
        attrs = {OPERATION: operation, REQUEST_MODEL: model, REQUEST_ID: request_id or None}
        self.groups = [("", attrs)]
        self.events = []
        self.ended = False
        self.attempts: list[AttemptSpan] = []
        self.arrived = arrived  # perf_counter: the start, turned into a time only if kept

    def decision(self, attrs: Mapping[str, Any]) -> None:
        self.groups.append((_GATEWAY, attrs))

    def budget_breach(self, kind: str, budget_ms: float, observed_ms: float) -> None:
        self.events.append((_time_ns(), "budget_breach", _breach(kind, budget_ms, observed_ms)))

    def attempt(
        self,
        *,
        base_url: str,
        upstream_model: str,
        backend: str,
        replica: str,
        hedge: bool = False,
        provider: str | None = None,
    ) -> AttemptSpan:
        index = len(self.attempts)
        attrs = attempt_attributes(
            self.operation, base_url, upstream_model, backend, replica, hedge, index, provider
        )
        attempt = AttemptSpan(self, f"{self.operation} {upstream_model}", attrs)
        attempt.recording = False  # times and outcome only; emitted with a failure trace
        self.attempts.append(attempt)
        return attempt

    def end(self, status: int, error_type: str | None = None) -> None:
        tracer = self.tracer
        if self.ended or tracer is None:
            return
        self.ended = True
        tracer.open -= 1
        failed = (status >= 500 and status != 499) or error_type is not None
        if not (failed or self.events) or not tracer.take_failure_token():
            return
        self.trace_id = _bits(128) or 1
        self.span_id = _bits(64) or 1
        self.parent_id = 0
        self.groups.append(("", {"gateway.trace.kept": "failure"}))
        now_ns = _time_ns()
        if self.arrived is not None:
            self.start_ns = now_ns - int((time.perf_counter() - self.arrived) * 1_000_000_000)
        for attempt in self.attempts:  # which replicas were tried, and how each went
            attempt.emit(self, self.trace_id, self.span_id, now_ns)
        self.recording = True
        self._record(status, error_type)


def _breach(kind: str, budget_ms: float, observed_ms: float) -> dict[str, Any]:
    return {
        "gateway.budget.kind": kind,
        "gateway.budget.limit_ms": budget_ms,
        "gateway.budget.observed_ms": observed_ms,
    }


NOOP_REQUEST = RequestSpan(None, "chat")
NOOP_STAGE = StageSpan(None, "", None)
NOOP_ATTEMPT = AttemptSpan(None, "", {})
