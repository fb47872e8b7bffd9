"""Tracing as the policy configures it: one span per request (GenAI conventions) and its children.

The spans themselves are ``gateway.observability.spans``: plain records on the event loop (no
SDK span objects), handed to ``gateway.observability.otlp``, which encodes OTLP protobuf in
chunks of records on the loop (records and encoding: ~55 us of loop time a traced request) and
sends it over HTTP or gRPC from its thread. The OpenTelemetry SDK is used only when a caller passes its own SDK ``SpanExporter`` (tests use the in-memory
one; an application embedding the gateway may pass any): the records are then turned into the
SDK's ``ReadableSpan`` in the export thread (or at once with ``batch=False``).

Settings come from the policy's ``telemetry`` section, else the standard variables:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base:
``/v1/traces`` is added for HTTP), ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``grpc``,
``http/protobuf``), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES`` (e.g. ``k8s.pod.name``);
``OTEL_SDK_DISABLED=true`` turns tracing off. A
policy endpoint is a base URL too. Disabled telemetry hands out one shared no-op request span.

Spans: ``gateway.observability.spans``; sampling and kept failure traces:
``gateway.observability.sampling``; attribute names: ``gateway.observability.span_attributes``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.otlp import Exporter
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.otlp_senders import sender_for
from gateway.observability.sampling import SpanSink, Tracer
from gateway.observability.span_attributes import UPSTREAM_RESPONSE_ID, response_attributes
from gateway.observability.span_records import (
    KIND_CLIENT,
    KIND_SERVER,
    STATUS_ERROR,
    SpanRecord,
    lazy,
    merged_attributes,
)
from gateway.observability.spans import (
    NOOP_ATTEMPT,
    NOOP_REQUEST,
    AttemptSpan,
    DeferredRequestSpan,
    RequestSpan,
    StageSpan,
)
from gateway.observability.summary import summarize_body
from policies.server import TelemetryConfig

if TYPE_CHECKING:  # the SDK is loaded only for a caller's own exporter
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "NOOP_ATTEMPT",
    "NOOP_REQUEST",
    "AttemptSpan",
    "DeferredRequestSpan",
    "ExportSettings",
    "RequestSpan",
    "SpanDropCollector",
    "StageSpan",
    "Telemetry",
    "body_attributes",
    "export_settings",
]

DEFAULT_SERVICE = "llm-gateway"
Protocol_ = Literal["http", "grpc"]


@dataclass(frozen=True, slots=True)
class ExportSettings:
    enabled: bool
    protocol: Protocol_
    endpoint: str
    service_name: str
    resource: tuple[tuple[str, str], ...] = ()  # OTEL_RESOURCE_ATTRIBUTES, service.name apart

    def resource_attributes(self) -> dict[str, str]:
        return {**dict(self.resource), "service.name": self.service_name}


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
    resource = resource_from_env(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    service = (
        config.service_name
        or environ.get("OTEL_SERVICE_NAME")
        or resource.pop("service.name", None)
        or DEFAULT_SERVICE
    )
    resource.pop("service.name", None)
    return ExportSettings(enabled, protocol, endpoint, service, tuple(resource.items()))


def resource_from_env(raw: str) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES``: ``key=value`` pairs separated by commas, values
    percent-encoded (the OpenTelemetry SDK's format); a pair without ``=`` or a key is skipped."""
    attributes: dict[str, str] = {}
    for pair in raw.split(","):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if sep and key:
            attributes[key] = unquote(value.strip())
    return attributes


def _signal_url(base: str, protocol: Protocol_) -> str:
    base = base.rstrip("/")
    if protocol == "grpc" or base.endswith("/v1/traces"):
        return base
    return base + "/v1/traces"


def body_attributes(body: bytes, client_id: str | None = None) -> tuple[str, Any]:
    """A non-streamed answer's GenAI response attributes, made when the span is exported
    (``RequestSpan.response_later``); ``client_id``: the id its client got, when not the
    upstream's (an answer re-told in another API)."""
    return (_ANSWER, body) if client_id is None else (_RETOLD, (body, client_id))


def hit_attributes(body: bytes, client_id: str | None) -> tuple[str, Any]:
    """A cache hit's, as ``body_attributes``, without ``gateway.upstream.response_id``: the
    replayed answer's id is the gateway's (no upstream made it)."""
    return (_HIT, (body, client_id))


def _answer_attributes(body: bytes, client_id: str | None = None) -> dict[str, Any]:
    summary = summarize_body(body)
    return response_attributes(summary.model, summary.response_id, summary.input_tokens,
                               summary.output_tokens, summary.finish_reasons,
                               client_id)  # fmt: skip


def _retold_attributes(answer: tuple[bytes, str]) -> dict[str, Any]:
    return _answer_attributes(*answer)


def _hit_attributes(answer: tuple[bytes, str | None]) -> dict[str, Any]:
    attributes = _answer_attributes(*answer)
    attributes[UPSTREAM_RESPONSE_ID] = None  # a None attribute is not sent
    return attributes


_ANSWER, _RETOLD, _HIT = "answer", "retold answer", "cache hit"
lazy(_ANSWER, _answer_attributes)
lazy(_RETOLD, _retold_attributes)
lazy(_HIT, _hit_attributes)


class Telemetry(Tracer):
    """The tracer a runtime uses, with the export it owns (flushed and stopped by ``shutdown``)."""

    def __init__(
        self,
        sink: SpanSink | None,
        *,
        exporter: Exporter | None = None,
        protocol: str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(sink, **settings)
        self.exporter = exporter
        self.protocol = protocol  # "http" | "grpc" for OTLP; None for a caller's exporter

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
        """Build from the policy; ``exporter`` (an SDK one) replaces OTLP, e.g. in tests."""
        env = os.environ if environ is None else environ
        settings = export_settings(config, env)
        if not settings.enabled:
            return cls.disabled()
        options: dict[str, Any] = {
            "record_content": config.record_content,
            "sample_ratio": config.sample_ratio,
            "trace_failures": config.trace_failures,
            "failure_traces_per_s": config.failure_traces_per_s,
        }
        resource = settings.resource_attributes()
        if exporter is not None:
            deliver = _sdk_delivery(exporter, resource)
            if not batch:
                return cls(_Immediate(deliver), **options)
            queue = Exporter(deliver, close=exporter.shutdown)
            return cls(queue, exporter=queue, **options)
        sender = sender_for(settings.protocol, settings.endpoint, config.headers)
        queue = Exporter.otlp(sender, Encoder(resource))
        return cls(queue, exporter=queue, protocol=settings.protocol, **options)

    async def drained(self, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait (at most ``timeout_s``) until every request span begun here has ended: a reload
        that replaces this telemetry stops it only then, so requests in flight keep their spans
        (and their resource, e.g. the old ``service.name``). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.open > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def shutdown(self) -> None:
        """Flush and stop the export (blocking: call it through ``asyncio.to_thread``). A span
        that ends later (a request that outlived ``drained``'s wait) is counted as dropped."""
        exporter = self.exporter
        if exporter is not None:
            self.sink = _CountedAsDropped(exporter)  # the exporter's last drain takes the rest
            exporter.force_flush()
            exporter.shutdown()

    @property
    def finished(self) -> bool:
        """Stopped, and no span of its own can still end: its counts will not change again."""
        return self.exporter is None or (self.exporter.stopped and self.open <= 0)

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self.exporter.force_flush(timeout_ms / 1000) if self.exporter is not None else True


class SpanDropCollector(Collector):
    """``llm_gateway_trace_spans_dropped_total`` (spans the export dropped: a full queue, a
    failed send, a span that ended after its telemetry stopped) and
    ``llm_gateway_trace_spans_unconfirmed_total`` (spans sent that the collector did not answer
    for in time: maybe received, never sent again), read at scrape time from the running
    telemetry's exporter and from those a reload replaced (until they are ``finished``, then as
    numbers kept here), so the totals never go back."""

    def __init__(self, telemetry: Callable[[], Telemetry]) -> None:
        self._telemetry = telemetry
        self._retired = [0, 0]  # what finished exporters dropped, and left unconfirmed
        self._replaced: list[Telemetry] = []  # replaced, maybe still draining or flushing
        self._current: Telemetry | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        telemetry = self._telemetry()
        if telemetry is not self._current:
            if self._current is not None:
                self._replaced.append(self._current)
            self._current = telemetry
        for old in [t for t in self._replaced if t.finished]:
            if old.exporter is not None:
                self._retired[0] += old.exporter.dropped
                self._retired[1] += old.exporter.unconfirmed
            self._replaced.remove(old)
        live = [t.exporter for t in (*self._replaced, telemetry) if t.exporter is not None]
        dropped = CounterMetricFamily(
            "llm_gateway_trace_spans_dropped",
            "Trace spans dropped by the export (its queue full, a send that failed twice, or a"
            " span that ended after a reload stopped its export)",
        )
        dropped.add_metric([], self._retired[0] + sum(e.dropped for e in live))
        yield dropped
        unconfirmed = CounterMetricFamily(
            "llm_gateway_trace_spans_unconfirmed",
            "Trace spans sent that the collector did not answer for within the timeout (maybe"
            " received; not sent again)",
        )
        unconfirmed.add_metric([], self._retired[1] + sum(e.unconfirmed for e in live))
        yield unconfirmed


class _CountedAsDropped:
    """The sink of a stopped telemetry: a span that ends now is counted, not queued."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def add(self, record: SpanRecord) -> None:
        self._exporter.dropped += 1


class _Immediate:
    """A sink that delivers each record at once, on the caller's thread (``batch=False``)."""

    def __init__(self, deliver: Any) -> None:
        self._deliver = deliver

    def add(self, record: SpanRecord) -> None:
        self._deliver([record])


def _sdk_delivery(exporter: SpanExporter, resource: Mapping[str, Any]) -> Any:
    """Records -> the SDK's ``ReadableSpan`` -> ``exporter.export`` (a caller's exporter)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
    from opentelemetry.trace.span import TraceState

    sdk_resource = Resource.create(dict(resource))
    scope = InstrumentationScope("llm_gateway")
    kinds = {KIND_SERVER: SpanKind.SERVER, KIND_CLIENT: SpanKind.CLIENT}
    sampled = TraceFlags(TraceFlags.SAMPLED)

    def plain(attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}

    def convert(record: SpanRecord) -> ReadableSpan:
        (trace_id, span_id, parent_id, name, kind, start_ns, end_ns, groups, events, status,
         message, trace_state) = record  # fmt: skip
        state = TraceState.from_header([trace_state]) if trace_state else None
        context = SpanContext(trace_id, span_id, False, sampled, state)
        parent = SpanContext(trace_id, parent_id, False, sampled, state) if parent_id else None
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=sdk_resource,
            attributes=plain(merged_attributes(groups)),
            events=[Event(n, plain(a or {}), at) for at, n, a in events],
            kind=kinds.get(kind, SpanKind.INTERNAL),
            status=Status(StatusCode.ERROR, message or None)
            if status == STATUS_ERROR
            else Status(StatusCode.UNSET),
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=scope,
        )

    def deliver(records: list[SpanRecord]) -> None:
        exporter.export([convert(r) for r in records])

    return deliver
