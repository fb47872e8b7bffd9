"""Lean tracing: span records on the loop, OTLP protobuf from the exporter, decoded here.

Every wire test sends through the real exporter thread to a real receiver (OTLP/HTTP on an
aiohttp server, OTLP/gRPC on a grpc server) and decodes the bytes with opentelemetry-proto's
generated classes: names, kinds, attributes, parentage, events and status as a collector sees
them.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import aiohttp
import grpc  # type: ignore[import-untyped]
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_upstream import site_port
from gateway.observability.otlp import Exporter
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.otlp_senders import GrpcSender, HttpSender
from gateway.observability.sampling import Tracer, parse_traceparent
from gateway.observability.span_attributes import MAX_TEXT
from gateway.observability.span_records import SpanRecord, lazy
from gateway.observability.spans import NOOP_REQUEST
from gateway.observability.tracing import SpanDropCollector, Telemetry, body_attributes
from tests.conftest import FakeFactory, GatewayFactory, pool_policy
from tests.gateway.observability.hedged_request import (
    CALLER_SPAN,
    CALLER_TRACE,
    TRACEPARENT,
    run_request,
)


class Receiver:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def spans(self) -> list[Span]:
        out: list[Span] = []
        for body in self.bodies:
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            for rs in message.resource_spans:
                assert rs.resource.attributes[0].key == "service.name"
                for ss in rs.scope_spans:
                    out.extend(ss.spans)
        return out


@pytest.fixture
async def http_receiver() -> AsyncIterator[tuple[Receiver, str]]:
    receiver = Receiver()

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        receiver.bodies.append(await request.read())
        return web.Response(body=ExportTraceServiceResponse().SerializeToString())

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield receiver, f"http://127.0.0.1:{site_port(site)}/v1/traces"
    await runner.cleanup()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    lock = threading.Lock()

    def export(body: bytes, context: Any) -> bytes:
        with lock:
            receiver.bodies.append(body)
        response: bytes = ExportTraceServiceResponse().SerializeToString()
        return response

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def attrs(span: Span | Span.Event) -> dict[str, Any]:
    def plain(value: AnyValue) -> Any:
        kind = value.WhichOneof("value")
        assert kind is not None
        if kind == "array_value":
            return [plain(v) for v in value.array_value.values]
        return getattr(value, kind)

    return {kv.key: plain(kv.value) for kv in span.attributes}


async def _export(tracer: Tracer, exporter: Exporter) -> None:
    assert await asyncio.to_thread(exporter.force_flush, 10.0)


async def test_a_request_trace_over_otlp_http(http_receiver: tuple[Receiver, str]) -> None:
    receiver, endpoint = http_receiver
    exporter = Exporter.otlp(HttpSender(endpoint, {}), Encoder({"service.name": "llm-gateway"}))
    tracer = Tracer(exporter, sample_ratio=0.0)  # the caller's sampled flag wins over the ratio
    upstream = run_request(tracer)
    await _export(tracer, exporter)
    exporter.shutdown()
    spans = receiver.spans()
    by_name: dict[str, list[Span]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == ["chat llama", "chat m", "gateway.cache.lookup", "gateway.route"]
    (root,) = by_name["chat m"]
    # The caller's trace is continued: same trace id, the caller's span as parent.
    assert root.trace_id.hex() == CALLER_TRACE
    assert root.parent_span_id.hex() == CALLER_SPAN
    assert root.trace_state == "vendor=1"
    assert root.kind == Span.SPAN_KIND_SERVER
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 16
    assert a["gen_ai.request.temperature"] == 0.2
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.response.model"] == "llama"
    assert a["gen_ai.usage.input_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 7
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert (a["server.address"], a["server.port"]) == ("10.0.0.2", 8001)
    assert a["gateway.surface"] == "voice"
    assert a["gateway.tenant"] == "team-a"
    assert a["gateway.hedge.winner"] == "hedge"
    assert a["gateway.budget.headroom_ms"] == -23.0
    assert "gateway.x" not in a  # None values are skipped
    assert "gen_ai.input.messages" not in a  # content is off unless opted in
    assert a["http.response.status_code"] == 200
    assert root.status.code == Status.STATUS_CODE_UNSET
    assert [e.name for e in root.events] == ["first_token", "budget_breach"]
    assert attrs(root.events[0]) == {"gateway.ttft_ms": 123.0}
    assert attrs(root.events[1])["gateway.budget.kind"] == "ttft"
    # Stages and attempts are children of the request span, in the same trace.
    children = [s for s in spans if s is not root]
    assert all(s.trace_id == root.trace_id for s in children)
    assert all(s.parent_span_id == root.span_id for s in children)
    assert attrs(by_name["gateway.route"][0]) == {"gateway.route.reason": "prefix"}
    assert by_name["gateway.route"][0].kind == Span.SPAN_KIND_INTERNAL
    first, hedge = sorted(by_name["chat llama"], key=lambda s: attrs(s)["gateway.attempt.index"])
    assert first.kind == hedge.kind == Span.SPAN_KIND_CLIENT
    assert attrs(first)["gateway.attempt.outcome"] == "cancelled"
    assert attrs(hedge)["gateway.attempt.outcome"] == "won"
    assert attrs(hedge)["gateway.replica"] == "r2"
    assert attrs(hedge)["gateway.attempt.hedge"] is True
    assert [e.name for e in hedge.events] == ["first_chunk"]
    assert first.start_time_unix_nano <= first.end_time_unix_nano
    # The upstream got the first attempt's context, and the caller's tracestate.
    parsed = parse_traceparent(upstream["traceparent"])
    assert parsed == (int(CALLER_TRACE, 16), int.from_bytes(first.span_id, "big"), True)
    assert upstream["tracestate"] == "vendor=1"


async def test_content_only_when_opted_in(http_receiver: tuple[Receiver, str]) -> None:
    receiver, endpoint = http_receiver
    exporter = Exporter.otlp(HttpSender(endpoint, {}), Encoder({"service.name": "x"}))
    run_request(Tracer(exporter, record_content=True), prompt="hello there")
    await _export(Tracer(exporter), exporter)
    exporter.shutdown()
    (root,) = [s for s in receiver.spans() if s.name == "chat m"]
    assert "hello there" in attrs(root)["gen_ai.input.messages"]
    assert attrs(root)["gen_ai.output.messages"] == '[{"content":"answer"}]'


def test_the_same_trace_over_otlp_grpc(grpc_receiver: tuple[Receiver, str]) -> None:
    receiver, endpoint = grpc_receiver
    exporter = Exporter.otlp(
        GrpcSender(endpoint, {"x-tenant": "t"}), Encoder({"service.name": "g"})
    )
    run_request(Tracer(exporter))
    assert exporter.force_flush(10.0)
    exporter.shutdown()
    names = sorted(s.name for s in receiver.spans())
    assert names == ["chat llama", "chat llama", "chat m", "gateway.cache.lookup", "gateway.route"]


class ListSink:
    def __init__(self) -> None:
        self.records: list[SpanRecord] = []

    def add(self, record: SpanRecord) -> None:
        self.records.append(record)

    def decoded(self) -> list[Span]:
        encoder = Encoder({"service.name": "t"})
        body = encoder.request([encoder.span(r) for r in self.records])
        receiver = Receiver()
        receiver.bodies.append(body)
        return receiver.spans()


def _request(tracer: Tracer, headers: dict[str, str], status: int, attempt: str = "ok") -> None:
    rs = tracer.start_request(operation="chat", request_model="m", headers=headers)
    rs.decision({"tenant": "t"})
    at = rs.attempt(base_url="http://h:1/v1", upstream_model="m", backend="b", replica="r")
    at.end(attempt, 502 if attempt == "http_5xx" else 200)
    rs.end(status, "bad_gateway" if status >= 500 else None)


def test_sampling_follows_the_caller_then_the_ratio() -> None:
    sink = ListSink()
    tracer = Tracer(sink, sample_ratio=0.0)
    _request(tracer, {}, 200)
    _request(tracer, {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"}, 200)  # unsampled
    _request(tracer, {"traceparent": "00-zz-not-valid"}, 200)  # invalid: the ratio decides
    assert sink.records == []
    _request(tracer, {"traceparent": TRACEPARENT}, 200)
    assert len(sink.records) == 2  # request + attempt
    everyone = Tracer(ListSink(), sample_ratio=1.0)
    assert everyone.start_request(operation="chat", request_model="m", headers={}).recording
    assert Tracer(None).start_request(operation="chat", request_model="m", headers={}) is (
        NOOP_REQUEST
    )


def test_unsampled_failures_are_kept_with_their_attempts_and_rate_limited() -> None:
    sink = ListSink()
    tracer = Tracer(sink, sample_ratio=0.0, trace_failures=True, failure_traces_per_s=2.0)
    _request(tracer, {}, 200)
    assert sink.records == []  # a success stays unrecorded
    _request(tracer, {}, 502, attempt="http_5xx")
    spans = sink.decoded()
    (root,) = [s for s in spans if not s.parent_span_id]
    (attempt,) = [s for s in spans if s.parent_span_id]
    assert attempt.parent_span_id == root.span_id
    assert attrs(root)["gateway.trace.kept"] == "failure"
    assert attrs(root)["gateway.tenant"] == "t"
    assert attrs(root)["error.type"] == "bad_gateway"
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert attrs(attempt)["gateway.attempt.outcome"] == "http_5xx"
    assert attempt.status.code == Status.STATUS_CODE_ERROR
    for _ in range(10):  # an outage: at most the bucket's worth
        _request(tracer, {}, 502, attempt="http_5xx")
    roots = [s for s in sink.decoded() if not s.parent_span_id]
    assert 2 <= len(roots) <= 3
    quiet = Tracer(ListSink(), sample_ratio=0.0, trace_failures=False)
    _request(quiet, {}, 502)
    assert isinstance(quiet.sink, ListSink) and quiet.sink.records == []


def test_a_full_queue_drops_and_counts_instead_of_growing() -> None:
    exporter = Exporter.otlp(
        HttpSender("http://127.0.0.1:9/v1/traces", {}),
        Encoder({}),
        max_queue=4,
        schedule_s=60.0,
        retry_s=0.0,
    )
    tracer = Tracer(exporter)
    for _ in range(10):
        _request(tracer, {}, 200)  # 20 spans into a queue of 4
    assert exporter.dropped == 16
    exporter.shutdown(5.0)  # the 4 queued spans meet a closed port: retried once, dropped
    assert (exporter.exported, exporter.dropped) == (0, 20)


def test_attributes_set_twice_are_sent_once() -> None:
    sink = ListSink()
    rs = Tracer(sink).start_request(operation="chat", request_model="m", headers={})
    rs.response(model="a", server_url="http://h:1/v1")
    rs.response(model="b", server_url="http://h:1/v1")  # e.g. a stream summary, then the body
    rs.decision({"replica": "r1"})
    rs.decision({"replica": "r2"})
    rs.end(200)
    (span,) = sink.decoded()
    keys = [kv.key for kv in span.attributes]
    assert len(keys) == len(set(keys))
    assert attrs(span)["gen_ai.response.model"] == "b"  # the last value wins, as in the SDK
    assert attrs(span)["gateway.replica"] == "r2"
    assert attrs(span)["server.address"] == "h"


def test_a_non_streamed_answer_is_summarized_in_the_export_thread() -> None:
    sink = ListSink()
    rs = Tracer(sink).start_request(operation="chat", request_model="m", headers={})
    answer = (
        b'{"id": "chatcmpl-1", "model": "llama", "choices": [{"index": 0, "finish_reason": '
        b'"stop", "message": {"role": "assistant", "content": "hi"}}], '
        b'"usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}'
    )
    rs.response_later(body_attributes(answer), "http://10.0.0.9:8000/v1")
    rs.response_later(body_attributes(b"not json"), "http://10.0.0.9:8000/v1")  # nothing from it
    rs.end(200)
    (span,) = sink.decoded()  # encoding is where it is parsed
    a = attrs(span)
    assert a["gen_ai.response.model"] == "llama"
    assert a["gen_ai.response.id"] == "chatcmpl-1"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (3, 1)
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert (a["server.address"], a["server.port"]) == ("10.0.0.9", 8000)


def test_a_lazy_group_is_merged_with_the_groups_after_it() -> None:
    sink = ListSink()
    rs = Tracer(sink).start_request(operation="chat", request_model="m", headers={})
    answer = b'{"id": "a-1", "model": "from-body", "choices": []}'
    rs.response_later(body_attributes(answer), "http://h:1/v1")
    rs.response(model="from-stream", server_url="http://other:2/v1")  # the same keys, later
    rs.end(200)
    (span,) = sink.decoded()
    keys = [kv.key for kv in span.attributes]
    assert len(keys) == len(set(keys))
    a = attrs(span)
    assert a["gen_ai.response.model"] == "from-stream"
    assert a["gen_ai.response.id"] == "a-1"  # from the body: the later group has none
    assert (a["server.address"], a["server.port"]) == ("other", 2)


def test_equal_values_of_different_types_keep_their_types() -> None:
    sink = ListSink()
    tracer = Tracer(sink)
    values: list[Any] = [1, 1.0, True, 0, 0.0, False, "1"]
    for value in values:  # one encoder for all spans: what it keeps must not mix them up
        rs = tracer.start_request(
            operation="chat", request_model="m", headers={}, body={"temperature": value}
        )
        rs.decision({"x": value})
        rs.end(200)
    spans = sink.decoded()
    sent = [attrs(s)["gateway.x"] for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    assert [(type(v), v) for v in sent] == [(type(v), v) for v in values]
    temperatures = [attrs(s)["gen_ai.request.temperature"] for s in spans]
    assert [type(v) for v in temperatures] == [type(v) for v in values]


def test_a_failing_lazy_function_costs_its_attributes_only() -> None:
    def boom(argument: object) -> dict[str, Any]:
        raise ValueError(argument)

    lazy("test-boom", boom)
    sink = ListSink()
    rs = Tracer(sink).start_request(operation="chat", request_model="m", headers={})
    rs.response_later(("test-boom", b"x"))
    rs.response_later(("not-registered", b"x"))
    rs.decision({"tenant": "t"})
    rs.end(200)
    (span,) = sink.decoded()
    assert attrs(span)["gateway.tenant"] == "t"
    assert attrs(span)["http.response.status_code"] == 200


def test_queued_records_are_plain_data() -> None:
    sink = ListSink()
    tracer = Tracer(sink)
    rs = tracer.start_request(operation="chat", request_model="m", headers={}, body={"seed": 1})
    rs.decision({"tenant": "t", "priority": 0, "budget.ttft_ms": None})
    at = rs.attempt(base_url="http://h:1/v1", upstream_model="m", backend="b", replica="r")
    at.first_chunk()
    at.end("ok", 200)
    rs.first_token(12.5)
    rs.response_later(body_attributes(b'{"id": "x"}'), "http://h:1/v1")
    rs.end(200)
    assert len(sink.records) == 2
    # No closure or object of ours waits in the queue: a record survives a pickle round trip.
    assert pickle.loads(pickle.dumps(sink.records)) == sink.records


class Batches:
    """A ``deliver`` that keeps what it was given; ``prepare`` notes the thread it ran on."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []

    def deliver(self, batch: list[tuple[int, int]]) -> None:
        self.items.extend(batch)

    @staticmethod
    def prepare(record: SpanRecord) -> tuple[int, int]:
        if record[0] == 13:
            raise ValueError("cannot encode")
        return threading.get_ident(), record[0]


def _record(n: int) -> SpanRecord:
    return (n, 1, 0, "s", 1, 0, 1, (), (), 0, "", "")


async def _on_the_loop(exporter: Exporter, batches: Batches, count: int) -> list[int]:
    """Add ``count`` records on this loop, let it run twice, flush: the records encoded here."""
    try:
        for n in range(count):
            exporter.add(_record(n))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert await asyncio.to_thread(exporter.force_flush, 10.0)
    finally:
        exporter.shutdown()
    assert sorted(n for _, n in batches.items) == list(range(count))
    loop_thread = threading.get_ident()
    return sorted(n for ident, n in batches.items if ident == loop_thread)


async def test_the_loop_encodes_full_chunks_and_the_thread_the_rest() -> None:
    batches = Batches()
    exporter = Exporter(batches.deliver, prepare=batches.prepare, chunk=4, schedule_s=60.0)
    # Two chunks of 4 on the loop, in two callbacks; the 2 short of a chunk: the export thread.
    assert await _on_the_loop(exporter, batches, 10) == list(range(8))
    assert exporter.exported == 10 and exporter.dropped == 0


async def test_a_chunk_holds_the_loop_about_a_millisecond_at_most() -> None:
    batches = Batches()

    def slow(record: SpanRecord) -> tuple[int, int]:
        time.sleep(0.005)  # e.g. a long answer to summarise
        return batches.prepare(record)

    exporter = Exporter(batches.deliver, prepare=slow, chunk=4, schedule_s=60.0)
    assert await _on_the_loop(exporter, batches, 4) == [0]


def test_a_record_that_cannot_be_encoded_is_dropped_alone() -> None:
    batches = Batches()
    exporter = Exporter(batches.deliver, prepare=batches.prepare, chunk=4, schedule_s=60.0)
    for n in (12, 13, 14):  # no running loop: the export thread encodes them
        exporter.add(_record(n))
    assert exporter.force_flush(10.0)
    exporter.shutdown()
    assert [n for _, n in batches.items] == [12, 14]
    assert (exporter.exported, exporter.dropped) == (2, 1)


def test_a_string_that_is_not_unicode_is_sent_replaced_not_lost() -> None:
    # JSON can carry a lone surrogate ("\\ud800"), not encodable as UTF-8: the gateway refuses
    # such a request, but an upstream's answer (summarised at encoding) may have one.
    sink = ListSink()
    tracer = Tracer(sink)
    rs = tracer.start_request(operation="chat", request_model="m\ud800", headers={})
    rs.decision({"tenant": "t\ud800"})
    at = rs.attempt(base_url="http://h:1/v1", upstream_model="m", backend="b", replica="r")
    at.end("ok", 200)
    rs.response_later(body_attributes(b'{"model": "x\\ud800"}'), "http://h:1/v1")
    rs.end(404, "model_not_found")
    _request(tracer, {}, 200)  # another request's spans, in the same batch
    spans = sink.decoded()
    assert len(spans) == 4
    (bad,) = [s for s in spans if s.name == "chat m\ufffd"]
    assert attrs(bad)["gateway.tenant"] == "t\ufffd"
    assert attrs(bad)["gen_ai.response.model"] == "x\ufffd"
    assert attrs(bad)["server.address"] == "h"
    assert attrs(bad)["error.type"] == "model_not_found"


def test_an_integer_past_int64_is_sent_as_text_not_as_a_corrupt_varint() -> None:
    # OTLP's int_value is an int64; JSON integers are unbounded (a caller's seed, an upstream's
    # token count). Each value lands in the span's own attribute, the edges of int64 as ints.
    sink = ListSink()
    tracer = Tracer(sink)
    values = {"seed": 10**30, "low": -(2**63) - 1, "top": 2**63 - 1, "bottom": -(2**63)}
    rs = tracer.start_request(operation="chat", request_model="m", headers={})
    rs.decision({**values, "list": [1, 2**64]})
    rs.end(200)
    _request(tracer, {}, 200)  # another request's spans, in the same batch
    spans = sink.decoded()
    assert len(spans) == 3
    got = attrs(spans[0])
    assert got["gateway.seed"] == str(10**30)
    assert got["gateway.low"] == str(-(2**63) - 1)
    assert (got["gateway.top"], got["gateway.bottom"]) == (2**63 - 1, -(2**63))
    assert got["gateway.list"] == [1, str(2**64)]


# --- through the app: the request path's spans, encoded and decoded as a collector would ----


class AppTraces:
    """The gateway's own exporter and encoder, delivering to a list of decoded spans."""

    def __init__(self, record_content: bool = False) -> None:
        self.encoder = Encoder({"service.name": "t"})
        self.receiver = Receiver()
        self.exporter = Exporter(self._deliver, prepare=self.encoder.span)
        self.telemetry = Telemetry(
            self.exporter, exporter=self.exporter, record_content=record_content
        )

    def _deliver(self, spans: list[bytes]) -> None:
        self.receiver.bodies.append(self.encoder.request(spans))

    async def spans(self) -> list[Span]:
        assert await asyncio.to_thread(self.exporter.force_flush, 10.0)
        return self.receiver.spans()


def _retained(obj: Any, seen: set[int]) -> int:
    """Bytes held by ``obj`` and what it holds (dicts, tuples, lists, sets; each object once)."""
    if id(obj) in seen or isinstance(obj, type):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_retained(k, seen) + _retained(v, seen) for k, v in obj.items())
    elif isinstance(obj, (tuple, list, frozenset, set)):
        size += sum(_retained(v, seen) for v in obj)
    return size


async def test_a_huge_model_name_makes_a_small_span_that_is_not_kept(
    make_gateway: GatewayFactory, make_fake: FakeFactory
) -> None:
    """A caller's model name of a megabyte (an unknown model: 404) is cut in the span's name and
    attributes, and nothing of it stays in the encoder's caches."""
    fake = await make_fake()
    traces = AppTraces()
    gw = await make_gateway(pool_policy([fake.url]), telemetry=traces.telemetry)
    async with aiohttp.ClientSession() as session:
        for i in range(8):
            model = f"{i}" + "x" * 2**20
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(gw.base_url + "/chat/completions", json=body) as r:
                assert r.status == 404
    spans = await traces.spans()
    assert len(spans) == 8
    for span in spans:
        model = attrs(span)["gen_ai.request.model"]
        assert len(model) == MAX_TEXT and model.endswith("x")
        assert span.name == "chat " + model
        assert span.ByteSize() < 2 * MAX_TEXT + 1024
    assert _retained(vars(traces.encoder), set()) < 256 * 1024


def test_the_encoders_caches_keep_no_large_strings() -> None:
    """Whatever reaches the encoder (spans are cut before it), its caches stay small: a long
    name, value or array is encoded each time and never kept."""
    encoder = Encoder({"service.name": "t"})
    for i in range(16):
        big = f"{i}" + "y" * 2**18
        groups = (("", {"model": big}), ("gateway.", {"tenant": big}), ("", {"list": [big]}))
        encoder.span((1, 2, 0, big, 1, 0, 1, groups, ((0, big, None),), 0, "", ""))
    assert _retained(vars(encoder), set()) < 64 * 1024


@pytest.mark.parametrize("record_content", [True, False])
async def test_the_request_path_records_content_only_when_opted_in(
    make_gateway: GatewayFactory, make_fake: FakeFactory, record_content: bool
) -> None:
    """``telemetry.record_content`` puts the prompt and the answer's text on the request's span,
    answered whole or streamed, in the chat API or another client API (Anthropic Messages)."""
    fake = await make_fake(reply="the fake answer")
    traces = AppTraces(record_content)
    gw = await make_gateway(pool_policy([fake.url]), telemetry=traces.telemetry)
    messages = [{"role": "user", "content": "a secret prompt"}]
    async with aiohttp.ClientSession() as session:
        for path in ("/chat/completions", "/messages"):
            for stream in (False, True):
                body = {"model": "m", "max_tokens": 16, "stream": stream, "messages": messages}
                async with session.post(gw.base_url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
    roots = [s for s in await traces.spans() if s.name == "chat m"]
    assert len(roots) == 4
    streamed = "tok0 tok1 tok2 tok3 "  # the fake streams one token a chunk
    for root, text in zip(roots, ["the fake answer", streamed] * 2, strict=True):
        got = attrs(root)
        if not record_content:
            assert "gen_ai.input.messages" not in got and "gen_ai.output.messages" not in got
            continue
        assert json.loads(got["gen_ai.input.messages"])[-1] == messages[0]
        (output,) = json.loads(got["gen_ai.output.messages"])
        assert output == {"role": "assistant", "content": text, "finish_reason": "stop"}


def _dropped_total(text: str) -> float:
    (value,) = [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_gateway_trace_spans_dropped"
        for sample in family.samples
    ]
    return value


async def test_dropped_spans_are_counted_in_metrics_and_told_once(
    make_gateway: GatewayFactory, make_fake: FakeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await make_fake()
    exporter = Exporter(lambda spans: None, max_queue=2, schedule_s=60.0)
    gw = await make_gateway(
        pool_policy([fake.url]), telemetry=Telemetry(exporter, exporter=exporter)
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        for _ in range(4):  # two spans each (the request's, the attempt's): the queue holds two
            async with session.post(gw.base_url + "/chat/completions", json=body) as r:
                assert r.status == 200
        async with session.get(gw.root + "/metrics") as r:
            dropped = _dropped_total(await r.text())
    assert dropped == exporter.dropped == 6
    told = [r for r in caplog.records if "trace export queue is full" in r.getMessage()]
    assert len(told) == 1


def test_dropped_spans_never_go_back_when_a_reload_replaces_the_export() -> None:
    def telemetry() -> Telemetry:
        exporter = Exporter(lambda spans: None, max_queue=1, schedule_s=60.0)
        return Telemetry(exporter, exporter=exporter)

    def collected() -> float:
        dropped, _unconfirmed = collector.collect()
        return float(dropped.samples[0].value)

    current = [telemetry()]
    collector = SpanDropCollector(lambda: current[0])
    for _ in range(3):
        _request(current[0], {}, 200)  # six spans, a queue of one: five dropped
    assert collected() == 5
    old, current[0] = current[0], telemetry()  # a reload with other telemetry settings
    _request(current[0], {}, 200)
    assert collected() == 6
    old.shutdown()
    assert collected() == 6  # the stopped exporter's count is kept, not read again
    assert collected() == 6
