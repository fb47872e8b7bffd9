"""OpenTelemetry tracing: one span per request (GenAI conventions), children per stage.

Setup. ``Telemetry.from_config`` builds its own ``TracerProvider`` (never the process-global
one) exporting over OTLP, HTTP or gRPC, through a ``BatchSpanProcessor`` (export runs in the
SDK's worker thread, off the event loop). Settings come from the policy's ``telemetry``
section, else the standard variables: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is),
``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base: ``/v1/traces`` is added for HTTP),
``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``grpc``, ``http/protobuf``), ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_SDK_DISABLED=true`` turns tracing off. A policy endpoint
is a base URL too. Disabled telemetry hands out one shared no-op request span whose methods
return at once.

Spans. ``start_request`` continues the caller's W3C trace context (``traceparent``,
``tracestate``) and opens a SERVER span named ``{gen_ai.operation.name} {gen_ai.request.model}``
with the GenAI attributes; ``child`` opens a stage span (cache lookup, routing); ``attempt``
opens a CLIENT span per upstream attempt (hedges and retries are siblings) and injects its
context into the upstream headers. Decisions are ``gateway.*`` attributes. Events:
``first_token`` and ``budget_breach``. Prompt and completion text are recorded only when the
policy's ``record_content`` is true.

Sampling. A request whose caller sent a ``traceparent`` follows the caller's sampled flag (the
SDK's parent-based sampler). Any other request is traced with probability ``sample_ratio``,
decided here before the SDK is touched: an unsampled request costs one ``random()`` call and
gets the shared no-op span. A traced request costs ~100 us of span work on the event loop
plus ~50 us per span of OTLP encoding in the export thread (measured in bench.overhead), which
is why the policy's default ratio is 1 % and the demo's is 100 %.

Failures are kept anyway (``trace_failures``, on by default): an unsampled request gets a
``DeferredRequestSpan`` that only notes its start time, decisions, budget breaches and
upstream attempts (replica, times, outcome), and becomes a real span at its end if it failed
(status >= 500, the client's own 499 excepted) or breached its budget, at most
``failure_traces_per_s`` a second (a token bucket, so an outage does not turn on full
tracing). Such a span carries ``gateway.trace.kept: failure`` and one CLIENT child per
attempt, with the times it really had; stage spans (cache lookup...) were not recorded.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from policies.server import TelemetryConfig

# GenAI semantic conventions (attribute names as the OpenTelemetry registry spells them).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
_REQUEST_PARAMS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
    "stream": "gen_ai.request.stream",
}
DEFAULT_SERVICE = "llm-gateway"
_PROPAGATOR = TraceContextTextMapPropagator()

Protocol_ = Literal["http", "grpc"]


@dataclass(frozen=True, slots=True)
class ExportSettings:
    enabled: bool
    protocol: Protocol_
    endpoint: str
    service_name: str


def export_settings(config: TelemetryConfig, environ: Mapping[str, str]) -> ExportSettings:
    enabled = config.enabled and environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
    raw_protocol = environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    )
    protocol: Protocol_ = config.protocol or ("grpc" if raw_protocol == "grpc" else "http")
    if config.endpoint is not None:
        endpoint = _signal_url(config.endpoint, protocol)
    elif "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in environ:
        endpoint = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    elif "OTEL_EXPORTER_OTLP_ENDPOINT" in environ:
        endpoint = _signal_url(environ["OTEL_EXPORTER_OTLP_ENDPOINT"], protocol)
    else:
        endpoint = (
            "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318/v1/traces"
        )
    service = config.service_name or environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE
    return ExportSettings(enabled, protocol, endpoint, service)


def _signal_url(base: str, protocol: Protocol_) -> str:
    base = base.rstrip("/")
    if protocol == "grpc" or base.endswith("/v1/traces"):
        return base
    return base + "/v1/traces"


def _exporter(settings: ExportSettings, headers: Mapping[str, str]) -> SpanExporter:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        insecure = settings.endpoint.startswith("http://")
        return GrpcExporter(
            endpoint=settings.endpoint, insecure=insecure, headers=dict(headers) or None
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.endpoint, headers=dict(headers) or None)


class Telemetry:
    def __init__(
        self,
        tracer: trace.Tracer | None,
        *,
        record_content: bool = False,
        provider: TracerProvider | None = None,
        sample_ratio: float = 1.0,
        trace_failures: bool = False,
        failure_traces_per_s: float = 10.0,
    ) -> None:
        self.tracer = tracer
        self.enabled = tracer is not None
        self.record_content = record_content
        self.provider = provider
        self.sample_ratio = sample_ratio
        self.trace_failures = trace_failures
        self._failure_rate = failure_traces_per_s
        self._failure_tokens = max(failure_traces_per_s, 1.0)
        self._failure_refilled = time.monotonic()

    @classmethod
    def disabled(cls) -> Telemetry:
        return cls(None)

    @classmethod
    def from_config(
        cls,
        config: TelemetryConfig,
        environ: Mapping[str, str] | None = None,
        *,
        exporter: SpanExporter | None = None,
        batch: bool = True,
    ) -> Telemetry:
        """Build from the policy; ``exporter`` replaces OTLP (tests: the in-memory one)."""
        env = os.environ if environ is None else environ
        settings = export_settings(config, env)
        if not settings.enabled:
            return cls.disabled()
        resource = Resource.create({"service.name": settings.service_name})
        # Root requests are sampled in start_request (cheaper than a non-recording SDK span);
        # the SDK only follows a caller's sampled flag.
        provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_ON))
        out = exporter if exporter is not None else _exporter(settings, config.headers)
        provider.add_span_processor(BatchSpanProcessor(out) if batch else SimpleSpanProcessor(out))
        tracer = provider.get_tracer("llm_gateway")
        return cls(
            tracer,
            record_content=config.record_content,
            provider=provider,
            sample_ratio=config.sample_ratio,
            trace_failures=config.trace_failures,
            failure_traces_per_s=config.failure_traces_per_s,
        )

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking: call it through ``asyncio.to_thread``)."""
        if self.provider is not None:
            self.provider.shutdown()

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self.provider.force_flush(timeout_ms) if self.provider is not None else True

    def start_request(
        self,
        *,
        operation: str,
        request_model: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any] | None = None,
    ) -> RequestSpan:
        """The request's span, continuing the caller's W3C trace context from ``headers``.

        ``operation`` is ``chat`` or ``text_completion``; ``body`` contributes the request
        parameters (max_tokens, temperature, top_p, seed, stream), never the prompt.
        """
        if self.tracer is None:
            return NOOP_REQUEST
        if (
            self.sample_ratio < 1.0
            and headers.get("traceparent") is None
            and random.random() >= self.sample_ratio
        ):
            if self.trace_failures:
                return DeferredRequestSpan(self, operation, request_model)
            return NOOP_REQUEST
        parent = _PROPAGATOR.extract(headers)
        attrs: dict[str, AttributeValue] = {OPERATION: operation, REQUEST_MODEL: request_model}
        if body is not None:
            for field, name in _REQUEST_PARAMS.items():
                value = body.get(field)
                if isinstance(value, bool | int | float | str):
                    attrs[name] = value
        span = self.tracer.start_span(
            f"{operation} {request_model}", context=parent, kind=SpanKind.SERVER, attributes=attrs
        )
        return RequestSpan(self, span, operation)

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
    """The span of one request and the helpers that hang stages and decisions on it."""

    __slots__ = ("_context", "operation", "recording", "span", "telemetry")

    def __init__(self, telemetry: Telemetry | None, span: Span, operation: str = "chat") -> None:
        self.telemetry = telemetry
        self.span = span
        self.operation = operation
        self.recording = telemetry is not None and span.is_recording()
        self._context = trace.set_span_in_context(span) if self.recording else Context()

    def decision(self, attrs: Mapping[str, AttributeValue | None]) -> None:
        """Set ``gateway.<key>`` for each key (None values are skipped)."""
        if self.recording:
            self.span.set_attributes(
                {f"gateway.{key}": value for key, value in attrs.items() if value is not None}
            )

    @contextmanager
    def child(self, name: str, attrs: Mapping[str, AttributeValue] | None = None) -> Iterator[Span]:
        """A stage span (``gateway.cache.lookup``, ``gateway.route``...), ended on exit."""
        if not self.recording or self.telemetry is None or self.telemetry.tracer is None:
            yield trace.INVALID_SPAN
            return
        span = self.telemetry.tracer.start_span(name, context=self._context, attributes=attrs)
        with trace.use_span(span, end_on_exit=True):
            yield span

    def attempt(
        self,
        *,
        base_url: str,
        upstream_model: str,
        backend: str,
        replica: str,
        hedge: bool = False,
        index: int = 0,
        provider: str | None = None,
    ) -> AttemptSpan:
        """A CLIENT span for one upstream attempt; end it with ``AttemptSpan.end``."""
        if not self.recording or self.telemetry is None or self.telemetry.tracer is None:
            return NOOP_ATTEMPT
        attrs = _attempt_attributes(
            self.operation, base_url, upstream_model, backend, replica, hedge, index, provider
        )
        span = self.telemetry.tracer.start_span(
            f"{self.operation} {upstream_model}",
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )
        return AttemptSpan(span)

    def first_token(self, ttft_ms: float) -> None:
        if self.recording:
            self.span.add_event("first_token", {"gateway.ttft_ms": ttft_ms})

    def budget_breach(self, kind: str, budget_ms: float, observed_ms: float) -> None:
        """``kind``: ttft | itl | total | queue."""
        if self.recording:
            self.span.add_event("budget_breach", _breach_attributes(kind, budget_ms, observed_ms))

    def response(
        self,
        *,
        model: str | None = None,
        response_id: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        server_url: str | None = None,
    ) -> None:
        if not self.recording:
            return
        attrs: dict[str, AttributeValue] = {}
        if model is not None:
            attrs[RESPONSE_MODEL] = model
        if response_id is not None:
            attrs[RESPONSE_ID] = response_id
        if input_tokens is not None:
            attrs[INPUT_TOKENS] = input_tokens
        if output_tokens is not None:
            attrs[OUTPUT_TOKENS] = output_tokens
        if finish_reasons:
            attrs[FINISH_REASONS] = list(finish_reasons)
        if server_url is not None:
            attrs.update(_server_attributes(server_url))
        self.span.set_attributes(attrs)

    def content(self, input_messages_json: str | None, output_messages_json: str | None) -> None:
        """Prompt and completion (JSON, GenAI message shape): only when the policy opts in."""
        if not self.recording or self.telemetry is None or not self.telemetry.record_content:
            return
        if input_messages_json is not None:
            self.span.set_attribute(INPUT_MESSAGES, input_messages_json)
        if output_messages_json is not None:
            self.span.set_attribute(OUTPUT_MESSAGES, output_messages_json)

    def end(self, status: int, error_type: str | None = None) -> None:
        if not self.recording:
            return
        attrs: dict[str, AttributeValue] = {"http.response.status_code": status}
        if error_type is not None:
            attrs["error.type"] = error_type
        self.span.set_attributes(attrs)
        if status >= 500 or error_type is not None:
            self.span.set_status(Status(StatusCode.ERROR, error_type))
        self.span.end()


class AttemptSpan:
    __slots__ = ("_ended", "recording", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.recording = span.is_recording()
        self._ended = False

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Write this attempt's ``traceparent``/``tracestate`` into the upstream headers."""
        if self.recording:
            _PROPAGATOR.inject(headers, context=trace.set_span_in_context(self.span))

    def first_chunk(self) -> None:
        if self.recording:
            self.span.add_event("first_chunk")

    def end(self, outcome: str, status: int | None = None) -> None:
        """``outcome``: ok | won | lost | cancelled | http_4xx | http_5xx | connect_error | timeout."""
        if not self.recording or self._ended:
            return
        self._ended = True
        _end_attempt(self.span, outcome, status)


def _attempt_attributes(
    operation: str,
    base_url: str,
    upstream_model: str,
    backend: str,
    replica: str,
    hedge: bool,
    index: int,
    provider: str | None,
) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        OPERATION: operation,
        REQUEST_MODEL: upstream_model,
        **_server_attributes(base_url),
        "gateway.backend": backend,
        "gateway.replica": replica,
        "gateway.attempt.hedge": hedge,
        "gateway.attempt.index": index,
    }
    if provider is not None:
        attrs[PROVIDER] = provider
    return attrs


def _end_attempt(span: Span, outcome: str, status: int | None, end_time: int | None = None) -> None:
    span.set_attribute("gateway.attempt.outcome", outcome)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if outcome in ("http_5xx", "connect_error", "timeout"):
        span.set_attribute("error.type", outcome)
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end(end_time)


class _DeferredAttempt(AttemptSpan):
    """An unsampled request's attempt: when and how it went, kept until the request ends."""

    __slots__ = ("args", "chunk_ns", "end_ns", "outcome", "start_ns", "status")

    def __init__(self, args: tuple[str, str, str, str, bool, int, str | None]) -> None:
        # Not AttemptSpan.__init__: a few stores, no span.
        self.span = trace.INVALID_SPAN
        self.recording = False
        self._ended = False
        self.args = args  # base_url, upstream_model, backend, replica, hedge, index, provider
        self.start_ns = time.time_ns()
        self.chunk_ns: int | None = None
        self.end_ns: int | None = None
        self.outcome = "cancelled"  # unless ended otherwise before the request
        self.status: int | None = None

    def first_chunk(self) -> None:
        self.chunk_ns = time.time_ns()

    def end(self, outcome: str, status: int | None = None) -> None:
        if self.end_ns is None:
            self.end_ns = time.time_ns()
            self.outcome = outcome
            self.status = status

    def materialize(
        self, tracer: trace.Tracer, operation: str, parent: Context, end_ns: int
    ) -> None:
        base_url, model, backend, replica, hedge, index, provider = self.args
        span = tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=_attempt_attributes(
                operation, base_url, model, backend, replica, hedge, index, provider
            ),
            start_time=self.start_ns,
        )
        if self.chunk_ns is not None:
            span.add_event("first_chunk", timestamp=self.chunk_ns)
        _end_attempt(span, self.outcome, self.status, self.end_ns or end_ns)


class DeferredRequestSpan(RequestSpan):
    """An unsampled request's span-to-be: a real span only if the request fails (see above)."""

    __slots__ = ("_attempts", "_breaches", "_decisions", "_model", "_start_ns")

    def __init__(self, telemetry: Telemetry, operation: str, request_model: str) -> None:
        # Not RequestSpan.__init__: nothing here may cost more than a few attribute stores.
        self.telemetry = telemetry
        self.span = trace.INVALID_SPAN
        self.operation = operation
        self.recording = False
        self._context = _EMPTY_CONTEXT
        self._start_ns = time.time_ns()
        self._model = request_model
        self._decisions: list[Mapping[str, AttributeValue | None]] = []
        self._breaches: list[tuple[int, dict[str, AttributeValue]]] = []
        self._attempts: list[_DeferredAttempt] = []

    def attempt(
        self,
        *,
        base_url: str,
        upstream_model: str,
        backend: str,
        replica: str,
        hedge: bool = False,
        index: int = 0,
        provider: str | None = None,
    ) -> AttemptSpan:
        attempt = _DeferredAttempt(
            (base_url, upstream_model, backend, replica, hedge, index, provider)
        )
        self._attempts.append(attempt)
        return attempt

    def decision(self, attrs: Mapping[str, AttributeValue | None]) -> None:
        self._decisions.append(attrs)  # formatted only if the span is ever made

    def budget_breach(self, kind: str, budget_ms: float, observed_ms: float) -> None:
        self._breaches.append((time.time_ns(), _breach_attributes(kind, budget_ms, observed_ms)))

    def end(self, status: int, error_type: str | None = None) -> None:
        failed = (status >= 500 and status != 499) or error_type is not None
        telemetry = self.telemetry
        if not (failed or self._breaches) or telemetry is None or telemetry.tracer is None:
            return
        if not telemetry.take_failure_token():
            return
        attrs: dict[str, AttributeValue] = {OPERATION: self.operation, REQUEST_MODEL: self._model}
        for decided in self._decisions:
            attrs.update({f"gateway.{k}": v for k, v in decided.items() if v is not None})
        attrs["gateway.trace.kept"] = "failure"
        span = telemetry.tracer.start_span(
            f"{self.operation} {self._model}",
            context=Context(),
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=self._start_ns,
        )
        for at_ns, event in self._breaches:
            span.add_event("budget_breach", event, timestamp=at_ns)
        parent = trace.set_span_in_context(span)
        now_ns = time.time_ns()
        for attempt in self._attempts:  # which replicas were tried, and how each went
            attempt.materialize(telemetry.tracer, self.operation, parent, now_ns)
        self.span = span
        self.recording = True
        super().end(status, error_type)


@lru_cache(maxsize=256)
def _server_attributes(url: str) -> dict[str, AttributeValue]:
    """``server.address`` and ``server.port`` of an upstream URL (parsed once per URL)."""
    parts = urlsplit(url)
    out: dict[str, AttributeValue] = {SERVER_ADDRESS: parts.hostname or url}
    if parts.port is not None:
        out[SERVER_PORT] = parts.port
    return out


def _breach_attributes(
    kind: str, budget_ms: float, observed_ms: float
) -> dict[str, AttributeValue]:
    return {
        "gateway.budget.kind": kind,
        "gateway.budget.limit_ms": budget_ms,
        "gateway.budget.observed_ms": observed_ms,
    }


_EMPTY_CONTEXT = Context()
NOOP_REQUEST = RequestSpan(None, trace.INVALID_SPAN)
NOOP_ATTEMPT = AttemptSpan(trace.INVALID_SPAN)
