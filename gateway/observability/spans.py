"""Request tracing without the SDK: plain records on the loop, OTLP encoded in chunks of them.

What a request's trace holds is what the OpenTelemetry SDK path recorded (GenAI conventions
for the request and each upstream attempt, ``gateway.*`` decision attributes, stage spans,
``first_token`` and ``budget_breach`` events, W3C trace context in and out), but the event loop
does none of the SDK's work: no span objects with locks, no attribute validation, no context
objects. A span here is a small slotted object collecting references (the decision dicts the
orchestrator already built, unformatted); at its end it becomes one ``SpanRecord`` tuple
appended to the exporter's queue (``gateway.observability.otlp``), which merges the attributes
and encodes OTLP protobuf a chunk of records at a time, later, and sends it from its thread.

Sampling (decided before anything is recorded). A request with a valid ``traceparent`` follows
the caller's sampled flag and continues its trace (``tracestate`` is kept and passed on). Any
other request is traced with probability ``sample_ratio``. An unsampled request gets, with
``trace_failures``, a ``DeferredRequestSpan`` that notes its start, decisions, breaches and
upstream attempts, and is recorded at its end only if it failed (status >= 500, the client's
own 499 excepted) or breached its budget, at most ``failure_traces_per_s`` a second (a token
bucket), as a new trace with ``gateway.trace.kept: failure`` and one CLIENT child per attempt
(stage spans are not kept); without it, the shared no-op span.

Times. The request's span starts when the request arrived (``Call.started``, before its body
was read: what OpenTelemetry asks of a server span), and ``gateway.ttft_ms`` (the client's
time to first token, upload included) is measured from the same instant, so the
``first_token`` event sits at ``start + ttft`` inside the span. Attempts are numbered in the
order they were opened (``gateway.attempt.index``: retries, hedges and a cascade's tiers). The
span carries the gateway's request id (``gateway.request.id``, the ``x-request-id`` answered).

Open spans. The tracer counts the request spans begun and not yet ended (``Tracer.open``, two
integer steps a traced request): a reload that replaces the telemetry keeps the old export
running until they have ended (``Telemetry.drained``).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Mapping, MutableMapping, Sequence
from functools import lru_cache
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway.observability.otlp import (
    CONSTANT,
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    LAZY,
    STATUS_ERROR,
    STATUS_UNSET,
    AttrGroup,
    Event,
    SpanRecord,
)

# GenAI semantic conventions (attribute names as the OpenTelemetry registry spells them).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
# The upstream's id of an answer its client got with another (re-told in the client's API).
UPSTREAM_RESPONSE_ID = "gateway.upstream.response_id"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
REQUEST_ID = "gateway.request.id"
_REQUEST_PARAMS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
    "stream": "gen_ai.request.stream",
}
_GATEWAY = "gateway."
# A caller's (or an upstream's) string in a span is cut to this many characters: a span is a
# few hundred bytes, and a 4 MB model name must not become a 4 MB span (which the encoder would
# keep in its caches and a collector would refuse with the whole batch).
MAX_TEXT = 256
# Recorded prompt and completion text (``record_content``) is cut to this many characters per
# attribute, ending with a marker that says how much was left out (the value is then no longer
# valid JSON): a 1 MB prompt must not be queued whole while the collector is slow, nor make a
# batch that the collector refuses (its default limit: 20 MiB a request).
MAX_CONTENT_CHARS = 8192
# An attempt's outcomes that are the replica's (or the gateway's) failure: the span's status is
# ERROR and error.type the outcome. A 4xx is the caller's or the account's: not the attempt's.
_FAILED_OUTCOMES = frozenset(("http_5xx", "connect_error", "timeout", "bad_status", "rejected_key",
                              "bad_answer", "idle_timeout", "answer_broken", "stream_error", "no_connection",
                              "abandoned"))  # fmt: skip

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_time_ns = time.time_ns
_bits = random.getrandbits


class SpanSink(Protocol):
    """Where finished records go (``otlp.Exporter``; tests may pass a list's ``append``)."""

    def add(self, record: SpanRecord) -> None: ...


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``, None if it is not valid."""
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_hex, parent_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class Tracer:
    def __init__(
        self,
        sink: SpanSink | None,
        *,
        record_content: bool = False,
        sample_ratio: float = 1.0,
        trace_failures: bool = False,
        failure_traces_per_s: float = 10.0,
    ) -> None:
        self.sink = sink
        self.enabled = sink is not None
        self.record_content = record_content
        self.sample_ratio = sample_ratio
        self.trace_failures = trace_failures
        self._failure_rate = failure_traces_per_s
        self._failure_tokens = max(failure_traces_per_s, 1.0)
        self._failure_refilled = time.monotonic()
        self.open = 0  # request spans begun and not ended (recorded, or deferred)

    def start_request(
        self,
        *,
        operation: str,
        request_model: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any] | None = None,
        started: float | None = None,
        request_id: str = "",
    ) -> RequestSpan:
        """The request's SERVER span (``operation``: chat, text_completion, embeddings);
        ``body`` gives the request parameters (max_tokens, temperature...), never the prompt;
        ``started``: ``time.perf_counter()`` when the request arrived (else now)."""
        if self.sink is None:
            return NOOP_REQUEST
        parent = None
        header = headers.get("traceparent")
        if header is not None:
            parent = parse_traceparent(header)
        if parent is None:
            if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
                if self.trace_failures:
                    self.open += 1
                    return DeferredRequestSpan(self, operation, request_model, request_id, started)
                return NOOP_REQUEST
            trace_id, parent_id, state = _bits(128) or 1, 0, ""
        else:
            trace_id, parent_id, sampled = parent
            if not sampled:
                return NOOP_REQUEST
            state = headers.get("tracestate", "")
        model = capped(request_model)
        attrs: dict[str, Any] = {OPERATION: operation, REQUEST_MODEL: model}
        if request_id:
            attrs[REQUEST_ID] = request_id
        if body is not None:
            for field, name in _REQUEST_PARAMS.items():
                value = body.get(field)
                if isinstance(value, (bool, int, float)):
                    attrs[name] = value
                elif isinstance(value, str):
                    attrs[name] = capped(value)
        self.open += 1
        span = RequestSpan(self, operation, f"{operation} {model}", trace_id, parent_id, state,
                           attrs)  # fmt: skip
        return _started(span, started)

    def take_failure_token(self) -> bool:
        """One failure trace from the bucket (refilled at ``failure_traces_per_s``)."""
        now = time.monotonic()
        cap = max(self._failure_rate, 1.0)
        self._failure_tokens = min(
            cap, self._failure_tokens + (now - self._failure_refilled) * self._failure_rate
        )
        self._failure_refilled = now
        if self._failure_tokens < 1.0:
            return False
        self._failure_tokens -= 1.0
        return True


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
        function registered with ``otlp.lazy``, its argument), e.g. the answer's bytes (the loop
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
    """An unsampled request's span-to-be: recorded only if the request fails (module comment)."""

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


def response_attributes(
    model: str | None,
    response_id: str | None,
    input_tokens: int | None,
    output_tokens: int | None,
    finish_reasons: Sequence[str],
    client_id: str | None = None,
) -> dict[str, Any]:
    """``gen_ai.response.id`` is the id the client got: ``client_id`` when it is not the
    upstream's (then ``UPSTREAM_RESPONSE_ID``)."""
    upstream_id = None if response_id is None else capped(response_id)
    return {
        RESPONSE_MODEL: None if model is None else capped(model),
        RESPONSE_ID: upstream_id if client_id is None else client_id,
        UPSTREAM_RESPONSE_ID: None if client_id is None else upstream_id,
        INPUT_TOKENS: input_tokens,
        OUTPUT_TOKENS: output_tokens,
        FINISH_REASONS: list(finish_reasons) or None,
    }


def capped(text: str) -> str:
    """``text`` cut to ``MAX_TEXT`` characters (a caller's model name, an upstream's id)."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT]


def capped_content(text: str | None) -> str | None:
    """Recorded content cut to ``MAX_CONTENT_CHARS``, with a marker saying what was cut."""
    if text is None or len(text) <= MAX_CONTENT_CHARS:
        return text
    return f"{text[:MAX_CONTENT_CHARS]}...[truncated: {len(text)} characters in all]"


def _started(span: RequestSpan, started: float | None) -> RequestSpan:
    """``span`` starting at ``started`` (``time.perf_counter()`` of the request's arrival)."""
    if started is not None:
        span.start_ns -= int((time.perf_counter() - started) * 1_000_000_000)
    return span


@lru_cache(maxsize=1024)
def attempt_attributes(
    operation: str,
    base_url: str,
    upstream_model: str,
    backend: str,
    replica: str,
    hedge: bool,
    index: int,
    provider: str | None,
) -> Mapping[str, Any]:
    """An attempt's attributes (one shared, never mutated mapping per distinct attempt)."""
    return {
        OPERATION: operation,
        REQUEST_MODEL: upstream_model,
        **server_attributes(base_url),
        "gateway.backend": backend,
        "gateway.replica": replica,
        "gateway.attempt.hedge": hedge,
        "gateway.attempt.index": index,
        PROVIDER: provider,
    }


@lru_cache(maxsize=256)
def server_attributes(url: str) -> Mapping[str, Any]:
    """``server.address`` and ``server.port`` of an upstream URL (parsed once per URL)."""
    parts = urlsplit(url)
    return {SERVER_ADDRESS: parts.hostname or url, SERVER_PORT: parts.port}


def _breach(kind: str, budget_ms: float, observed_ms: float) -> dict[str, Any]:
    return {
        "gateway.budget.kind": kind,
        "gateway.budget.limit_ms": budget_ms,
        "gateway.budget.observed_ms": observed_ms,
    }


NOOP_REQUEST = RequestSpan(None, "chat")
NOOP_STAGE = StageSpan(None, "", None)
NOOP_ATTEMPT = AttemptSpan(None, "", {})
