"""What a request's span says of its answer is what the client got: a stream the surface's
deadline cut, an answer re-told in another client API, an answer from the cache."""

from __future__ import annotations

from typing import Any

import aiohttp
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.observability.tracing import Telemetry
from policies.server import TelemetryConfig
from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy

MESSAGES: Any = [{"role": "user", "content": "Tell me a long story."}]
DEADLINE = {"default": {"budget": {"total_ms": 400}, "actions": {"deadline": True}}}


def traced() -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=1.0)
    return Telemetry.from_config(config, exporter=exporter, batch=False), exporter


def spans_of(exporter: InMemorySpanExporter, kind: SpanKind) -> list[dict[str, Any]]:
    found: list[ReadableSpan] = [s for s in exporter.get_finished_spans() if s.kind is kind]
    return [dict(s.attributes or {}) for s in found]


async def metric(gw: RunningGateway, name: str, label: str = "") -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and label in line
    )


async def test_a_stream_the_deadline_cut_is_incomplete_and_traced_as_the_client_saw_it(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The stream ends with ``finish_reason: length`` and the usage charged for it: the span
    says both, and its attempt is ``incomplete`` (a time limit of ours), not ``ok``."""
    up = await make_fake(chunks=100, chunk_interval_ms=20)
    telemetry, exporter = traced()
    gw = await make_gateway(pool_policy([up.url], surfaces=DEADLINE), telemetry=telemetry)
    for asked in (True, False):
        exporter.clear()
        tokens_before = await metric(gw, "llm_gateway_tokens_total", 'kind="output"')
        options: Any = {"stream_options": {"include_usage": True}} if asked else {}
        stream = await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, **options
        )
        chunks = [c async for c in stream]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and len(finishes) < 100, asked
        charged = await metric(gw, "llm_gateway_tokens_total", 'kind="output"') - tokens_before
        assert charged > 0
        (span,) = spans_of(exporter, SpanKind.SERVER)
        assert span["gateway.deadline.hit"] is True
        assert span["gen_ai.response.finish_reasons"] == ("length",)
        assert span["gen_ai.usage.output_tokens"] == charged, asked
        assert span["gen_ai.usage.input_tokens"] > 0
        if asked:  # the usage the client was told is the span's
            usage = chunks[-1].usage
            assert usage is not None
            assert usage.completion_tokens == span["gen_ai.usage.output_tokens"]
            assert usage.prompt_tokens == span["gen_ai.usage.input_tokens"]
        (attempt,) = spans_of(exporter, SpanKind.CLIENT)
        assert attempt["gateway.attempt.outcome"] == "incomplete"
    attempts = "llm_gateway_upstream_attempts_total{"
    assert await metric(gw, attempts, 'outcome="incomplete"') == 2
    assert await metric(gw, attempts, 'outcome="ok"') == 0
