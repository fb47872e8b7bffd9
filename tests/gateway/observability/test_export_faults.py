"""The trace export against a slow collector and across a telemetry's end: what is sent, once,
and what is counted (dropped, or unconfirmed: maybe received)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.core import CounterMetricFamily

from bench.fake_upstream import site_port
from gateway.observability.otlp import Exporter
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.otlp_senders import HttpSender
from gateway.observability.span_records import SpanRecord
from gateway.observability.tracing import SpanDropCollector, Telemetry


class SlowCollector:
    """Receives every batch, and answers each ``delay_s`` later."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.span_ids: list[bytes] = []
        self.posts = 0

    async def traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.posts += 1
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.span_ids.extend(s.span_id for s in scope.spans)
        await asyncio.sleep(self.delay_s)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString())


@pytest.fixture
async def slow_collector() -> AsyncIterator[tuple[SlowCollector, str]]:
    collector = SlowCollector(delay_s=1.5)
    app = web.Application()
    app.router.add_post("/v1/traces", collector.traces)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield collector, f"http://127.0.0.1:{site_port(site)}/v1/traces"
    await runner.cleanup()


def _record(n: int, size: int = 0) -> SpanRecord:
    groups = (("", {"n": n, "pad": "p" * size}),)
    return (1, n + 1, 0, "span", 1, 0, 1, groups, (), 0, "", "")


def _counts(collector: SpanDropCollector) -> tuple[float, float]:
    families: list[CounterMetricFamily] = list(collector.collect())
    dropped, unconfirmed = (f.samples[0].value for f in families)
    return dropped, unconfirmed


async def test_a_batch_the_collector_answers_too_late_is_sent_once_and_not_counted_dropped(
    slow_collector: tuple[SlowCollector, str],
) -> None:
    """The collector takes every batch and answers after the sender's timeout: each span
    arrives once (the batch was sent again: twice), counted as unconfirmed, not dropped."""
    collector, endpoint = slow_collector
    sender = HttpSender(endpoint, {}, timeout_s=0.5)
    exporter = Exporter.otlp(sender, Encoder({"service.name": "t"}), retry_s=0.0)
    telemetry = Telemetry(exporter, exporter=exporter)
    for n in range(20):
        exporter.add(_record(n))
    assert await asyncio.to_thread(exporter.force_flush, 20.0)
    await asyncio.sleep(collector.delay_s + 0.5)  # a second post, if any, has arrived too
    assert sorted(collector.span_ids) == sorted(n.to_bytes(8, "big") for n in range(1, 21))
    assert (exporter.dropped, exporter.unconfirmed) == (0, 20)
    assert _counts(SpanDropCollector(lambda: telemetry)) == (0, 20)
    await asyncio.to_thread(exporter.shutdown)


def test_a_batch_is_bounded_in_bytes() -> None:
    """Spans of 300 KB: a request holds at most ``batch_bytes`` of them (one whole span at
    least), not 512 spans (150 MB, which a collector refuses whole)."""
    encoder = Encoder({"service.name": "t"})
    sizes: list[int] = []
    exporter = Exporter(
        lambda spans: sizes.append(sum(map(len, spans))),
        prepare=encoder.span,
        batch_bytes=1_000_000,
        schedule_s=60.0,
    )
    for n in range(10):
        exporter.add(_record(n, size=300_000))
    assert exporter.force_flush(10.0)
    assert len(sizes) > 1 and max(sizes) < 1_000_000 + 300_100
    exporter.shutdown()


async def test_a_span_that_ends_after_its_telemetry_stopped_is_counted_dropped() -> None:
    """A request outlives the reload's wait for it: its span, ended after the old telemetry
    stopped, is counted in llm_gateway_trace_spans_dropped_total (it was queued where nothing
    would send it, and counted nowhere)."""
    delivered: list[object] = []
    exporter = Exporter(delivered.extend)
    old = Telemetry(exporter, exporter=exporter)
    span = old.start_request(operation="chat", request_model="m", headers={})
    assert old.open == 1 and not await old.drained(0.2, poll_s=0.05)
    current = [old]
    collector = SpanDropCollector(lambda: current[0])
    assert _counts(collector) == (0, 0)
    current[0] = Telemetry.disabled()  # the reload's
    await asyncio.to_thread(old.shutdown)
    assert not old.finished  # its span may still end: its count is read again
    span.attempt(base_url="http://u/v1", upstream_model="m", backend="b", replica="r").end("ok")
    span.end(200)
    assert old.open == 0 and old.finished
    assert _counts(collector) == (2, 0)
    assert _counts(collector) == (2, 0)  # kept once the telemetry is finished, not read again
    assert delivered == []


async def test_a_hung_collector_holds_at_most_the_queues_bytes() -> None:
    """A collector that reads every request and never answers, and spans of 20 KB (what
    ``record_content`` makes of a long prompt): the export holds at most ``max_queue_bytes``
    of them (waiting or being sent), not 8,192 spans; the rest are dropped and counted."""
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = HttpSender(f"http://127.0.0.1:{port}/v1/traces", {}, timeout_s=120.0)
    bound = 2_000_000
    exporter = Exporter.otlp(
        sender, Encoder({"service.name": "t"}), max_queue_bytes=bound, batch_bytes=500_000,
        schedule_s=0.05, retry_s=0.0,
    )  # fmt: skip
    held: list[int] = []
    try:
        for n in range(1000):  # 20 MB of spans
            exporter.add(_record(n, size=20_000))
            if n % 32 == 31:
                await asyncio.sleep(0.01)  # the loop encodes a chunk; the thread sends
                queued = list(exporter._queue)  # what the export holds that is not sent yet
                held.append(sum(map(len, queued)))
        for _ in range(200):  # the thread's first batch reached the collector (and hangs)
            if hung:
                break
            await asyncio.sleep(0.05)
        assert hung and max(held) <= bound and 0 < exporter.held_bytes <= bound
        # ~100 spans held (one batch of them sent), the last records short of a chunk waiting
        assert exporter.exported == 0 and exporter.dropped > 800
        telemetry = Telemetry(exporter, exporter=exporter)
        assert _counts(SpanDropCollector(lambda: telemetry)) == (exporter.dropped, 0)
    finally:
        for writer in hung:
            writer.transport.abort()  # the send fails: the thread can end
        server.close()
        await asyncio.to_thread(exporter.shutdown)


async def test_the_loop_and_the_thread_encoding_at_once_hold_at_most_the_bound() -> None:
    """The export thread encodes a span (a long answer to summarise) while the loop's chunk
    callback encodes another: together they hold at most ``max_queue_bytes``, where each used
    to fill the room it saw when it started (up to twice the bound)."""
    encoder = Encoder({"service.name": "t"})
    inside, go_on, hung = threading.Event(), threading.Event(), threading.Event()

    def prepare(record: SpanRecord) -> bytes:
        if record[1] == 1:  # the thread's span: it waits inside the encoding
            inside.set()
            go_on.wait(10)
        return encoder.span(record)

    def deliver(batch: list[bytes]) -> None:  # a hung collector
        hung.wait(10)

    span_bytes = len(encoder.span(_record(0, size=600)))
    bound = span_bytes * 3 // 2  # room for one span, not two
    exporter = Exporter(deliver, prepare=prepare, chunk=1, schedule_s=0.01, max_queue_bytes=bound)
    try:
        await asyncio.to_thread(exporter.add, _record(0, size=600))  # no loop: the thread's
        assert await asyncio.to_thread(inside.wait, 10)
        exporter.add(_record(1, size=600))  # the loop's callback encodes it meanwhile
        await asyncio.sleep(0)  # the callback, scheduled first, has run
        assert exporter.held_bytes == span_bytes and exporter.dropped == 0
        go_on.set()
        for _ in range(1000):  # the thread's pass ends: its span dropped, or held over the bound
            if exporter.dropped or exporter.held_bytes > span_bytes:
                break
            await asyncio.sleep(0.01)
        assert exporter.held_bytes <= bound and exporter.dropped == 1
    finally:
        go_on.set()
        hung.set()
        await asyncio.to_thread(exporter.shutdown)
