"""What a request's trace says, through the gateway, decoded as a collector sees it: the
times of its span and events, its attempts' numbers, its request id, the content recorded,
and spans kept across a reload that replaces the telemetry."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from bench.fake_upstream import site_port
from gateway.observability.otlp import Exporter
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.span_attributes import MAX_CONTENT_CHARS
from gateway.observability.tracing import Telemetry
from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, vllm
from tests.e2e.conftest import KEY_ENV, AnthropicFactory

SERVER, CLIENT = 2, 3
MESSAGES: Any = [{"role": "user", "content": "hi"}]


def attrs(span: Span | Span.Event) -> dict[str, Any]:
    def plain(value: AnyValue) -> Any:
        kind = value.WhichOneof("value")
        if kind == "array_value":
            return [plain(v) for v in value.array_value.values]
        return getattr(value, kind) if kind else None

    return {kv.key: plain(kv.value) for kv in span.attributes}


class Traces:
    """The gateway's own exporter and encoder, delivering to decoded spans."""

    def __init__(self, record_content: bool = False) -> None:
        self.encoder = Encoder({"service.name": "test"})
        self.spans: list[Span] = []
        self.exporter = Exporter(self._deliver, prepare=self.encoder.span)
        self.telemetry = Telemetry(
            self.exporter, exporter=self.exporter, record_content=record_content
        )

    def _deliver(self, encoded: list[bytes]) -> None:
        message = ExportTraceServiceRequest()
        message.ParseFromString(self.encoder.request(encoded))
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)

    async def roots(self) -> list[Span]:
        assert await asyncio.to_thread(self.exporter.force_flush, 10.0)
        return [s for s in self.spans if s.kind == SERVER]


async def test_the_first_token_event_is_when_the_first_token_came(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A stream of 5 chunks 150 ms apart: its ``first_token`` event sits ``gateway.ttft_ms``
    after the span's start, long before its end (it was stamped at the end)."""
    fake = await make_fake(chunks=5, chunk_interval_ms=150)
    traces = Traces()
    gw = await make_gateway(pool_policy([fake.url]), telemetry=traces.telemetry)
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    async for _ in stream:
        pass
    (root,) = await traces.roots()
    (event,) = [e for e in root.events if e.name == "first_token"]
    ttft_ns = attrs(event)["gateway.ttft_ms"] * 1_000_000
    assert abs(event.time_unix_nano - root.start_time_unix_nano - ttft_ns) < 1_000_000
    assert root.end_time_unix_nano - event.time_unix_nano > 400_000_000  # 4 gaps of 150 ms


async def _slow_upload(url: str, body: dict[str, Any], headers: dict[str, str]) -> str:
    """POST ``body`` in two pieces 1 s apart (a slow client's upload); the answer's text."""
    raw = json.dumps(body).encode()

    async def pieces() -> AsyncIterator[bytes]:
        yield raw[:10]
        await asyncio.sleep(1.0)
        yield raw[10:]

    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=pieces(), headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.text()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_the_span_starts_at_arrival_so_ttft_fits_in_it(
    make_fake: FakeFactory, make_gateway: GatewayFactory, path: str
) -> None:
    """A body uploaded over 1 s: the span starts when the request arrived, as TTFT does, so
    ``gateway.ttft_ms`` (upload included) is within the span (the span began after the
    upload: 3 ms long, with a TTFT of 1,000 ms); the same for another client API."""
    fake = await make_fake(chunks=2)
    traces = Traces()
    gw = await make_gateway(pool_policy([fake.url]), telemetry=traces.telemetry)
    body = {"model": "m", "max_tokens": 8, "messages": MESSAGES, "stream": True}
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    await _slow_upload(gw.root + path, body, headers)
    (root,) = await traces.roots()
    duration_ns = root.end_time_unix_nano - root.start_time_unix_nano
    (event,) = [e for e in root.events if e.name == "first_token"]
    ttft_ms = attrs(event)["gateway.ttft_ms"]
    assert duration_ns >= 900_000_000  # the upload is inside the span
    assert ttft_ms >= 900
    assert ttft_ms * 1_000_000 <= duration_ns
    assert root.start_time_unix_nano <= event.time_unix_nano <= root.end_time_unix_nano


async def test_attempts_are_numbered_and_the_span_names_the_request_id(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Both replicas answer 503: the try and the retry are attempts 0 and 1 (both were 0); the
    server span carries the request id answered in ``x-request-id``."""
    a, b = await make_fake(), await make_fake()
    a.fake.queue("status:503")
    b.fake.queue("status:503")
    traces = Traces()
    gw = await make_gateway(pool_policy([a.url, b.url]), telemetry=traces.telemetry)
    headers = {"x-request-id": "req-trace-me-1"}
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "messages": MESSAGES}
        async with session.post(gw.base_url + "/chat/completions", json=body, headers=headers) as r:
            assert r.status == 502
            assert r.headers["x-request-id"] == "req-trace-me-1"
    (root,) = await traces.roots()
    assert attrs(root)["gateway.request.id"] == "req-trace-me-1"
    tries = [attrs(s) for s in traces.spans if s.kind == CLIENT]
    assert sorted(t["gateway.attempt.index"] for t in tries) == [0, 1]


def _content(root: Span) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    got = attrs(root)
    return json.loads(got["gen_ai.input.messages"]), json.loads(got["gen_ai.output.messages"])


@pytest.mark.parametrize("stream", [False, True])
async def test_content_of_an_anthropic_passthrough_is_recorded(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory, stream: bool
) -> None:
    """A Messages request relayed to Anthropic untranslated: the answer's text (it was "") and
    the top-level ``system`` (it was left out), the usage and the stop reason."""
    claude = await make_anthropic()
    backends = {"claude": {"kind": "anthropic", "base_url": claude.url, "api_key_env": KEY_ENV}}
    models = {"c": {"backend": "claude", "model": "claude-test-1"}}
    traces = Traces(record_content=True)
    gw = await make_gateway(build_policy(backends, models), telemetry=traces.telemetry)
    async with anthropic.AsyncAnthropic(base_url=gw.root, api_key="k", max_retries=0) as client:
        args: Any = {"model": "c", "max_tokens": 16, "system": "Be brief.", "messages": MESSAGES}
        if stream:
            async with client.messages.stream(**args) as events:
                text = await events.get_final_text()
        else:
            message = await client.messages.create(**args)
            text = "".join(b.text for b in message.content if b.type == "text")
    assert text
    (root,) = await traces.roots()
    inputs, (output,) = _content(root)
    assert inputs == [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert output == {"role": "assistant", "content": text, "finish_reason": "end_turn"}
    assert attrs(root)["gen_ai.usage.input_tokens"] == 11


@pytest.mark.parametrize("stream", [False, True])
async def test_content_of_a_responses_passthrough_is_recorded(
    make_fake: FakeFactory, make_gateway: GatewayFactory, stream: bool
) -> None:
    """A Responses request relayed untranslated: its ``instructions`` and the answer's text."""
    up = await make_fake(reply="the passthrough answer")
    models = {"m": {"backend": "up", "model": "fake-model"}}
    policy = build_policy({"up": vllm(up.url, responses="passthrough")}, models)
    traces = Traces(record_content=True)
    gw = await make_gateway(policy, telemetry=traces.telemetry)
    args: Any = {"model": "m", "input": "hi", "instructions": "Be brief."}
    if stream:
        text = ""
        async for event in await gw.client.responses.create(**args, stream=True):
            if event.type == "response.output_text.delta":
                text += event.delta
    else:
        text = (await gw.client.responses.create(**args)).output_text
    assert text
    (root,) = await traces.roots()
    inputs, (output,) = _content(root)
    assert inputs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert output["content"] == text


async def test_recorded_content_is_cut(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A prompt of a megabyte is recorded cut to ``MAX_CONTENT_CHARS``, saying so (it was
    recorded whole: a batch of such spans is refused by a collector, and queued they hold
    hundreds of MB while it is slow)."""
    fake = await make_fake()
    traces = Traces(record_content=True)
    gw = await make_gateway(pool_policy([fake.url]), telemetry=traces.telemetry)
    prompt = "x" * 2**20
    messages: Any = [{"role": "user", "content": prompt}]
    await gw.client.chat.completions.create(model="m", messages=messages)
    (root,) = await traces.roots()
    recorded = attrs(root)["gen_ai.input.messages"]
    assert MAX_CONTENT_CHARS <= len(recorded) < MAX_CONTENT_CHARS + 100
    assert recorded.endswith(f"...[truncated: {len(json.dumps(messages))} characters in all]")
    assert root.ByteSize() < 2 * MAX_CONTENT_CHARS + 4096


# --- a reload that replaces the telemetry -------------------------------------------------------


class OtlpReceiver:
    """An OTLP/HTTP receiver on loopback: each span with its resource's ``service.name``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []

    async def traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            service = {kv.key: kv.value.string_value for kv in resource.resource.attributes}
            for scope in resource.scope_spans:
                self.spans.extend((service["service.name"], s) for s in scope.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString())

    async def wait_for(self, name: str, kind: int, timeout_s: float = 20.0) -> str:
        """The service name of the first span called ``name`` of ``kind`` to arrive."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service, span in self.spans:
                if span.name == name and span.kind == kind:
                    return service
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {name!r} span arrived: {[s.name for _, s in self.spans]}")


@pytest.fixture
async def otlp_receiver() -> AsyncIterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield receiver, f"http://127.0.0.1:{site_port(site)}"
    await runner.cleanup()


async def test_a_reload_that_replaces_telemetry_keeps_the_spans_of_requests_in_flight(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    tmp_path: Path,
    otlp_receiver: tuple[OtlpReceiver, str],
) -> None:
    """A 2 s stream, and a reload changing ``telemetry.service_name`` once it began: its server
    and client spans arrive, under the service it began with (they were lost: the old export
    stopped at once, and what it was given after was queued where nothing drained it)."""
    receiver, endpoint = otlp_receiver
    fake = await make_fake(chunks=8, chunk_interval_ms=250)

    def policy(service: str) -> str:
        telemetry = {"enabled": True, "endpoint": endpoint, "service_name": service}
        return pool_policy([fake.url], telemetry={**telemetry, "sample_ratio": 1.0})

    path = tmp_path / "policy.yaml"
    path.write_text(policy("before"))
    gw = await make_gateway(path.read_text(), policy_path=path)
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = aiter(stream)
    await anext(chunks)
    path.write_text(policy("after"))
    async with aiohttp.ClientSession() as session, session.post(gw.root + "/admin/reload") as r:
        assert r.status == 200, await r.text()
    async for _ in chunks:
        pass
    assert await receiver.wait_for("chat fake-model", CLIENT) == "before"
    assert await receiver.wait_for("chat m", SERVER) == "before"
    await gw.client.chat.completions.create(model="m", messages=MESSAGES)  # the new telemetry's
    async with aiohttp.ClientSession() as session, session.get(gw.root + "/metrics") as r:
        metrics = await r.text()
    assert "llm_gateway_trace_spans_dropped_total 0.0" in metrics


async def test_a_cache_hit_carries_no_upstream_response_id(
    make_fake: FakeFactory, make_gateway: GatewayFactory, otlp_receiver: tuple[OtlpReceiver, str]
) -> None:
    """A Responses client's answer re-told from chat: a live one's span carries the upstream's
    id beside the client's; a cache hit's only the id its client got (the replayed answer's id
    is the gateway's: no upstream made it)."""
    receiver, endpoint = otlp_receiver
    fake = await make_fake()
    telemetry = {"enabled": True, "endpoint": endpoint, "sample_ratio": 1.0}
    cached = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(pool_policy([fake.url], telemetry=telemetry, surfaces=cached))
    live = await gw.client.responses.create(model="m", input="hi", temperature=0)
    assert gw.runtime.cache is not None
    await gw.runtime.cache.drain()
    hit = await gw.client.responses.with_raw_response.create(model="m", input="hi", temperature=0)
    assert hit.headers["x-gateway-cache"] == "exact" and len(fake.fake.requests) == 1
    deadline = time.monotonic() + 20.0
    while len(roots := [s for _, s in receiver.spans if s.kind == SERVER]) < 2:
        assert time.monotonic() < deadline, "the spans never arrived"
        await asyncio.sleep(0.1)
    second, first = sorted(
        (attrs(s) for s in roots), key=lambda a: a.get("gateway.replica") != "cache"
    )
    assert first["gen_ai.response.id"] == live.id
    assert first["gateway.upstream.response_id"] == "fake-1"
    assert second["gateway.replica"] == "cache"
    assert second["gen_ai.response.id"] == hit.parse().id
    assert "gateway.upstream.response_id" not in second
