"""Tracing: GenAI span shape, W3C context in and out, content opt-in, OTLP export."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from bench.fake_upstream import site_port
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.tracing import NOOP_REQUEST, Telemetry, export_settings
from policies.server import TelemetryConfig
from tests.gateway.observability.hedged_request import (
    CALLER_SPAN,
    CALLER_TRACE,
    TRACEPARENT,
)
from tests.gateway.observability.hedged_request import run_request as _run


def traced(record_content: bool = False) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, record_content=record_content, sample_ratio=1.0)
    return Telemetry.from_config(config, {}, exporter=exporter, batch=False), exporter


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def test_request_span_follows_the_genai_conventions() -> None:
    tel, exporter = traced()
    _run(tel, keep_incoming=True)
    spans = by_name(exporter.get_finished_spans())
    root = spans["chat m"]
    assert root.kind is SpanKind.SERVER
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.temperature"] == 0.2
    assert attrs["gen_ai.response.model"] == "llama"
    assert attrs["gen_ai.usage.input_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 7
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("stop",)  # type: ignore[arg-type]
    assert (attrs["server.address"], attrs["server.port"]) == ("10.0.0.2", 8001)
    assert attrs["gateway.surface"] == "voice" and attrs["gateway.hedge.winner"] == "hedge"
    assert "gateway.x" not in attrs
    assert [e.name for e in root.events] == ["first_token", "budget_breach"]


def test_caller_context_is_continued_and_stages_are_children() -> None:
    tel, exporter = traced()
    _run(tel, keep_incoming=True)
    spans = by_name(exporter.get_finished_spans())
    root = spans["chat m"]
    assert root.parent is not None and format(root.parent.span_id, "016x") == CALLER_SPAN
    assert format(root.context.trace_id, "032x") == CALLER_TRACE
    for name in ("gateway.cache.lookup", "gateway.route"):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == root.context.span_id
    attempts = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert len(attempts) == 2  # the hedge is a sibling of the first attempt
    assert {s.parent.span_id for s in attempts if s.parent} == {root.context.span_id}
    outcomes = {dict(s.attributes or {})["gateway.attempt.outcome"] for s in attempts}
    assert outcomes == {"cancelled", "won"}


def test_upstream_headers_carry_the_attempt_span() -> None:
    tel, exporter = traced()
    upstream = _run(tel, keep_incoming=True)
    first = next(
        s
        for s in exporter.get_finished_spans()
        if dict(s.attributes or {}).get("gateway.replica") == "r1"
    )
    version, trace_id, span_id, _ = upstream["traceparent"].split("-")
    assert (version, trace_id) == ("00", CALLER_TRACE)
    assert span_id == format(first.context.span_id, "016x")
    assert upstream["tracestate"] == "vendor=1"


def test_content_is_never_recorded_unless_opted_in() -> None:
    tel, exporter = traced(record_content=False)
    _run(tel, keep_incoming=True)
    for span in exporter.get_finished_spans():
        for value in dict(span.attributes or {}).values():
            assert "secret prompt" not in str(value)
    tel2, exporter2 = traced(record_content=True)
    _run(tel2, keep_incoming=True)
    root = by_name(exporter2.get_finished_spans())["chat m"]
    assert "secret prompt" in str(dict(root.attributes or {})["gen_ai.input.messages"])


def test_errors_mark_the_span() -> None:
    tel, exporter = traced()
    rs = tel.start_request(operation="text_completion", request_model="m", headers={})
    attempt = rs.attempt(base_url="http://h:1/v1", upstream_model="m", backend="b", replica="r")
    attempt.end("connect_error")
    rs.end(503, "no_healthy_replica")
    spans = by_name(exporter.get_finished_spans())
    assert spans["text_completion m"].status.status_code is StatusCode.ERROR
    assert spans["text_completion m"].parent is None  # no caller context: a new trace
    assert dict(spans["text_completion m"].attributes or {})["error.type"] == "no_healthy_replica"


def test_disabled_telemetry_is_a_shared_no_op() -> None:
    tel = Telemetry.from_config(TelemetryConfig(enabled=False), {})
    rs = tel.start_request(operation="chat", request_model="m", headers={})
    assert rs is NOOP_REQUEST and not rs.recording
    headers: dict[str, str] = {"traceparent": TRACEPARENT}
    _run(tel, keep_incoming=True)  # every helper is callable and does nothing
    rs.attempt(base_url="http://h:1", upstream_model="m", backend="b", replica="r").inject(headers)
    assert headers == {"traceparent": TRACEPARENT}  # the caller's context passes untouched
    assert not Telemetry.from_config(
        TelemetryConfig(enabled=True), {"OTEL_SDK_DISABLED": "true"}
    ).enabled


def test_sampling_ratio_applies_to_roots_and_the_callers_flag_always_wins() -> None:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=0.25)
    tel = Telemetry.from_config(config, {}, exporter=exporter, batch=False)
    assert TelemetryConfig(enabled=True).sample_ratio == 0.1  # the shipped default
    roots = [tel.start_request(operation="chat", request_model="m", headers={}) for _ in range(800)]
    for rs in roots:
        rs.end(200)
    traced = len(exporter.get_finished_spans())
    assert 130 <= traced <= 270, traced  # 200 expected; binomial sd ~12
    assert sum(not rs.recording for rs in roots) == 800 - traced
    exporter.clear()
    unsampled_parent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
    for parent, expected in ((TRACEPARENT, 50), (unsampled_parent, 0)):
        for _ in range(50):
            headers = {"traceparent": parent}
            tel.start_request(operation="chat", request_model="m", headers=headers).end(200)
        assert len(exporter.get_finished_spans()) == expected
        exporter.clear()
    never = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=0.0), {}, exporter=exporter, batch=False
    )
    for _ in range(100):
        never.start_request(operation="chat", request_model="m", headers={}).end(200)
    assert exporter.get_finished_spans() == ()


def unsampled(**settings: Any) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=0.0, **settings)
    return Telemetry.from_config(config, {}, exporter=exporter, batch=False), exporter


def test_unsampled_failures_and_budget_breaches_are_kept_as_root_spans() -> None:
    tel, exporter = unsampled()
    for status in (200, 404, 499):  # success, a client's error, a client that left: dropped
        rs = tel.start_request(operation="chat", request_model="m", headers={})
        rs.decision({"surface": "chat", "replica": "r1"})
        rs.end(status)
    assert exporter.get_finished_spans() == ()
    rs = tel.start_request(operation="chat", request_model="m", headers={})
    assert not rs.recording  # nothing recorded while it runs: no child spans, no events
    with rs.child("gateway.route"):
        pass
    rs.decision({"surface": "chat", "replica": "r1", "route.reason": "prefix", "x": None})
    rs.end(503, "no_healthy_replica")
    rs = tel.start_request(operation="chat", request_model="m", headers={})
    rs.budget_breach("ttft", 500.0, 812.5)
    rs.end(200)
    failed, breached = exporter.get_finished_spans()
    attrs = dict(failed.attributes or {})
    assert failed.name == "chat m" and failed.kind is SpanKind.SERVER and failed.parent is None
    assert attrs["gateway.trace.kept"] == "failure"
    assert attrs["gateway.replica"] == "r1" and attrs["gateway.route.reason"] == "prefix"
    assert "gateway.x" not in attrs
    assert attrs["error.type"] == "no_healthy_replica"
    assert attrs["http.response.status_code"] == 503
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.start_time is not None and failed.end_time is not None
    assert failed.start_time <= failed.end_time
    assert breached.status.status_code is not StatusCode.ERROR
    (event,) = breached.events
    assert event.name == "budget_breach"
    assert dict(event.attributes or {})["gateway.budget.observed_ms"] == 812.5


def test_a_kept_failure_shows_each_attempt_with_its_own_times() -> None:
    tel, exporter = unsampled()
    rs = tel.start_request(operation="chat", request_model="m", headers={})
    first = rs.attempt(base_url="http://10.0.0.1:8000/v1", upstream_model="up-m",
                       backend="pool", replica="10.0.0.1:8000")  # fmt: skip
    headers: dict[str, str] = {}
    first.inject(headers)
    assert headers == {}  # an unsampled request propagates no context upstream
    first.end("http_5xx", 503)
    second = rs.attempt(base_url="http://10.0.0.2:8000/v1", upstream_model="up-m",
                        backend="pool", replica="10.0.0.2:8000")  # fmt: skip
    second.first_chunk()
    second.end("connect_error")
    rs.attempt(
        base_url="http://10.0.0.3:8000/v1",
        upstream_model="up-m",
        backend="pool",
        replica="10.0.0.3:8000",
    )  # fmt: skip  (never ended: cancelled; attempts are numbered in order)
    ok = tel.start_request(operation="chat", request_model="m", headers={})
    ok.attempt(base_url="http://10.0.0.1:8000/v1", upstream_model="up-m", backend="pool",
               replica="10.0.0.1:8000").end("ok", 200)  # fmt: skip
    ok.end(200)
    assert exporter.get_finished_spans() == ()  # a success leaves nothing, attempts included
    rs.end(502, "bad_gateway")
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.parent is None]
    attempts = sorted((s for s in spans if s.parent is not None),
                      key=lambda s: str(dict(s.attributes or {})["gateway.attempt.index"]))  # fmt: skip
    assert len(attempts) == 3
    assert root.context is not None
    for span in attempts:
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.context is not None and span.context.trace_id == root.context.trace_id
        assert span.kind is SpanKind.CLIENT and span.name == "chat up-m"
        assert root.start_time is not None and root.end_time is not None
        assert span.start_time is not None and span.end_time is not None
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    a1, a2, a3 = (dict(s.attributes or {}) for s in attempts)
    assert a1["gateway.replica"] == "10.0.0.1:8000" and a1["gateway.attempt.outcome"] == "http_5xx"
    assert a1["http.response.status_code"] == 503 and a1["server.port"] == 8000
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert a2["gateway.attempt.outcome"] == "connect_error"
    assert [e.name for e in attempts[1].events] == ["first_chunk"]
    assert a3["gateway.attempt.outcome"] == "cancelled"
    assert attempts[0].end_time is not None and attempts[1].start_time is not None
    assert attempts[0].end_time <= attempts[1].start_time  # real times, in order


def test_spans_start_when_the_request_arrived_sampled_or_kept_as_a_failure() -> None:
    """``started`` (the arrival, before the body was read) is the span's start, for a traced
    request and for an unsampled one kept because it failed."""
    for tel, exporter in (traced(), unsampled()):
        arrived = time.perf_counter() - 2.0  # a body that took 2 s to upload
        rs = tel.start_request(operation="chat", request_model="m", headers={}, started=arrived)
        rs.end(502, "bad_gateway")
        (root,) = exporter.get_finished_spans()
        assert root.start_time is not None and root.end_time is not None
        assert 1.9e9 < root.end_time - root.start_time < 10e9
        assert tel.open == 0


def test_failure_traces_are_rate_limited_and_can_be_turned_off() -> None:
    tel, exporter = unsampled(failure_traces_per_s=3)
    for _ in range(40):
        tel.start_request(operation="chat", request_model="m", headers={}).end(502)
    assert 3 <= len(exporter.get_finished_spans()) <= 4  # the bucket, plus a refill at most
    off, exporter = unsampled(trace_failures=False)
    rs = off.start_request(operation="chat", request_model="m", headers={})
    assert rs is NOOP_REQUEST
    rs.end(502)
    assert exporter.get_finished_spans() == ()


def test_export_settings_from_policy_then_environment() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_SERVICE_NAME": "gw-from-env",
    }
    s = export_settings(TelemetryConfig(enabled=True), env)
    assert (s.protocol, s.endpoint, s.service_name) == (
        "http",
        "http://collector:4318/v1/traces",
        "gw-from-env",
    )
    s = export_settings(TelemetryConfig(enabled=True), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (s.protocol, s.endpoint) == ("grpc", "http://localhost:4317")
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:1/custom"}
    assert export_settings(TelemetryConfig(enabled=True), env).endpoint == "http://x:1/custom"
    cfg = TelemetryConfig(
        enabled=True, endpoint="http://phoenix:6006", protocol="http", service_name="gw"
    )
    s = export_settings(cfg, env)
    assert (s.endpoint, s.service_name) == ("http://phoenix:6006/v1/traces", "gw")


def test_grpc_export_is_built_for_grpc() -> None:
    """The gRPC path itself is exercised against a real server in test_lean_tracing."""
    cfg = TelemetryConfig(enabled=True, protocol="grpc", endpoint="http://127.0.0.1:1")
    tel = Telemetry.from_config(cfg, {})
    assert tel.protocol == "grpc" and tel.exporter is not None
    tel.exporter.shutdown(1.0)  # nothing queued: nothing is sent


async def test_spans_reach_a_real_otlp_http_receiver() -> None:
    received: list[ExportTraceServiceRequest] = []
    got = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        got.set()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        cfg = TelemetryConfig(
            enabled=True,
            endpoint=f"http://127.0.0.1:{site_port(site)}",
            service_name="gw-test",
            sample_ratio=1.0,
        )
        tel = Telemetry.from_config(cfg, {})
        _run(tel, keep_incoming=True)
        # The exporter posts from its thread; the receiver runs on this loop.
        assert await asyncio.to_thread(tel.force_flush, 10_000)
        await asyncio.wait_for(got.wait(), 10)
        await asyncio.to_thread(tel.shutdown)
    finally:
        await runner.cleanup()
    spans = [
        span
        for message in received
        for resource_spans in message.resource_spans
        for scope in resource_spans.scope_spans
        for span in scope.spans
    ]
    services = {
        attr.value.string_value
        for message in received
        for resource_spans in message.resource_spans
        for attr in resource_spans.resource.attributes
        if attr.key == "service.name"
    }
    assert services == {"gw-test"}
    names = sorted(s.name for s in spans)
    assert names == sorted(
        ["chat m", "chat llama", "chat llama", "gateway.cache.lookup", "gateway.route"]
    )
    root = next(s for s in spans if s.name == "chat m")
    assert root.trace_id.hex() == CALLER_TRACE
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 7
    assert attrs["gen_ai.request.model"].string_value == "m"


def test_resource_attributes_come_from_the_environment() -> None:
    """``OTEL_RESOURCE_ATTRIBUTES`` (what the Kubernetes manifest sets: pod, namespace) reaches
    the exported resource; the service name's own settings win over its ``service.name``."""
    env = {
        "OTEL_RESOURCE_ATTRIBUTES": (
            "k8s.pod.name=gw-7f9c, k8s.namespace.name=llm-gateway,service.name=from-attrs,"
            "team=a%2Cb,broken,=nokey"
        )
    }
    s = export_settings(TelemetryConfig(enabled=True), env)
    assert s.service_name == "from-attrs"
    assert s.resource_attributes() == {
        "k8s.pod.name": "gw-7f9c",
        "k8s.namespace.name": "llm-gateway",
        "team": "a,b",
        "service.name": "from-attrs",
    }
    s = export_settings(TelemetryConfig(enabled=True), {**env, "OTEL_SERVICE_NAME": "svc"})
    assert s.resource_attributes()["service.name"] == "svc"
    encoded = Encoder(s.resource_attributes()).request([])
    assert b"k8s.pod.name" in encoded and b"gw-7f9c" in encoded
