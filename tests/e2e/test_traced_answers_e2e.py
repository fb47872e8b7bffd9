"""What a request's span says of its answer is what the client got: a stream the surface's
deadline cut, an answer re-told in another client API, an answer from the cache."""

from __future__ import annotations

from typing import Any

import anthropic
from openai.types.responses import ResponseCompletedEvent
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.observability.tracing import Telemetry
from policies.server import TelemetryConfig
from tests.conftest import FakeFactory, GatewayFactory, pool_policy
from tests.e2e.limits_helpers import metric

MESSAGES: Any = [{"role": "user", "content": "Tell me a long story."}]
DEADLINE = {"default": {"budget": {"total_ms": 400}, "actions": {"deadline": True}}}
CACHED = {"default": {"cache": {"exact": True}}}


def traced() -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=1.0)
    return Telemetry.from_config(config, exporter=exporter, batch=False), exporter


def spans_of(exporter: InMemorySpanExporter, kind: SpanKind) -> list[dict[str, Any]]:
    found: list[ReadableSpan] = [s for s in exporter.get_finished_spans() if s.kind is kind]
    return [dict(s.attributes or {}) for s in found]


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
        tokens_before = await metric([gw], "llm_gateway_tokens_total", kind="output")
        options: Any = {"stream_options": {"include_usage": True}} if asked else {}
        stream = await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, **options
        )
        chunks = [c async for c in stream]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and len(finishes) < 100, asked
        charged = await metric([gw], "llm_gateway_tokens_total", kind="output") - tokens_before
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
    attempts = "llm_gateway_upstream_attempts_total"
    assert await metric([gw], attempts, outcome="incomplete") == 2
    assert await metric([gw], attempts, outcome="ok") == 0


async def test_a_translated_answer_is_traced_with_the_id_its_client_got(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A Responses or Messages answer re-told from chat carries the gateway's id (resp_...,
    msg_...): the span's ``gen_ai.response.id`` is that one, the upstream's goes beside it."""
    up = await make_fake()
    telemetry, exporter = traced()
    gw = await make_gateway(pool_policy([up.url]), telemetry=telemetry)
    claude = anthropic.AsyncAnthropic(base_url=gw.root, api_key="unused", max_retries=0)
    told: list[str] = []
    for stream in (False, True):
        if stream:
            async with claude.messages.stream(model="m", max_tokens=16, messages=MESSAGES) as s:
                told.append((await s.get_final_message()).id)
            events = await gw.client.responses.create(model="m", input="hi", stream=True)
            told += [e.response.id async for e in events if isinstance(e, ResponseCompletedEvent)]
        else:
            message = await claude.messages.create(model="m", max_tokens=16, messages=MESSAGES)
            told.append(message.id)
            told.append((await gw.client.responses.create(model="m", input="hi")).id)
    await claude.close()
    spans = spans_of(exporter, SpanKind.SERVER)
    assert [s["gen_ai.response.id"] for s in spans] == told
    assert [i[:4] for i in told] == ["msg_", "resp", "msg_", "resp"]
    assert {s["gateway.upstream.response_id"] for s in spans} == {"fake-1"}


async def test_a_cache_hit_is_traced_with_its_answer_and_the_cache_as_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A hit's span names the stored answer's model and id (the replayed one the client got;
    a Responses client's own) and ``gateway.replica: cache``, as a live answer's span names
    its replica."""
    up = await make_fake()
    telemetry, exporter = traced()
    gw = await make_gateway(pool_policy([up.url], surfaces=CACHED), telemetry=telemetry)
    request: Any = {"model": "m", "messages": MESSAGES, "temperature": 0}
    await gw.client.chat.completions.create(**request)
    await gw.client.responses.create(model="m", input="hi", temperature=0)
    assert gw.runtime.cache is not None
    await gw.runtime.cache.drain()
    exporter.clear()
    raw = await gw.client.chat.completions.with_raw_response.create(**request)
    assert raw.headers["x-gateway-cache"] == "exact"
    response = await gw.client.responses.create(model="m", input="hi", temperature=0)
    chat, responses = spans_of(exporter, SpanKind.SERVER)
    assert chat["gen_ai.response.model"] == responses["gen_ai.response.model"] == "fake-model"
    assert chat["gen_ai.response.id"] == raw.parse().id
    assert responses["gen_ai.response.id"] == response.id
    assert chat["gateway.replica"] == responses["gateway.replica"] == "cache"
    assert len(up.fake.requests) == 2
