"""Tiered model aliases through the real gateway: route by difficulty, and the cascade."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.observability.tracing import Telemetry
from policies.server import TelemetryConfig
from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningFake,
    RunningGateway,
    build_policy,
    vllm,
)
from tests.e2e.limits_helpers import metric

MESSAGES: Any = [{"role": "user", "content": "Tom has 3 boxes of 4 apples. How many apples?"}]
GOOD = "3 boxes x 4 apples = 12 apples. #### 12"


def policy(small: RunningFake, large: RunningFake, surfaces: Any = None, **tier: Any) -> str:
    """``auto`` over a small vLLM-like backend and a large OpenAI-like one; ``tier``: its settings."""
    backends = {"small": vllm(small.url), "large": {"kind": "openai", "base_url": large.url}}
    auto = {"tiers": ["small", {"backend": "large", "model": "big-model"}], **tier}
    extra = {"surfaces": surfaces} if surfaces else {}
    return build_policy(backends, {"auto": auto}, **extra)


async def test_route_mode_follows_the_threshold(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply="small"), await make_fake(reply="large")
    everything_large = await make_gateway(policy(small, large, mode="route", threshold=-1.0))
    raw = await everything_large.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES
    )
    assert raw.headers["x-gateway-tier"] == "large"
    assert raw.parse().choices[0].message.content == "large"
    assert large.fake.requests[-1].body["model"] == "big-model"
    score = float(raw.headers["x-gateway-difficulty"])
    assert -1.0 <= score <= 1.0
    nothing_large = await make_gateway(policy(small, large, mode="route", threshold=1.0))
    raw = await nothing_large.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES
    )
    assert raw.headers["x-gateway-tier"] == "small"
    assert len(small.fake.requests) == 1 and len(large.fake.requests) == 1
    # The shipped threshold splits real prompts: an easy one and a hard one differ in score.
    shipped = await make_gateway(policy(small, large, mode="route"))
    easy = await shipped.client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "What is 2 + 2?"}]
    )
    hard = await shipped.client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[
            {
                "role": "user",
                "content": "A train leaves at 3:15 pm at 48 km/h; a second leaves "
                "the same station 40 minutes later at 64 km/h. At what time, to the minute, does "
                "the second catch the first, and how far from the station?",
            }
        ],
    )
    assert float(easy.headers["x-gateway-difficulty"]) != float(
        hard.headers["x-gateway-difficulty"]
    )


async def test_cascade_keeps_a_good_small_answer_and_streams_it(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply=GOOD), await make_fake(reply="large")
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=1.0))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    assert raw.headers["x-gateway-cascade"] == "kept"
    assert raw.headers["x-gateway-tier"] == "small"
    chunks = [c async for c in raw.parse()]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == GOOD
    assert chunks[-1].usage is not None
    assert small.fake.requests[-1].body.get("stream") is None  # asked whole, not streamed
    assert large.fake.requests == []


async def test_cascade_escalates_and_the_client_sees_only_the_large_stream(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply="I am not sure."), await make_fake(chunks=3)
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=-1.0))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, stream=True
    )
    assert raw.headers["x-gateway-cascade"] == "escalated"
    assert raw.headers["x-gateway-tier"] == "large"
    assert float(raw.headers["x-gateway-escalation-ms"]) >= 0
    texts = [c.choices[0].delta.content async for c in raw.parse() if c.choices]
    assert texts == ["tok0 ", "tok1 ", "tok2 "]
    assert len(small.fake.requests) == 1 and len(large.fake.requests) == 1
    for _ in range(3):  # escalated whole (not streamed) as well
        await gw.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert len(small.fake.requests) == 4 and len(large.fake.requests) == 4
    assert_no_load_left(gw)


async def test_empty_small_answer_always_escalates(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply=""), await make_fake(reply="large answer")
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=1.0))
    r = await gw.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert r.choices[0].message.content == "large answer"
    assert_no_load_left(gw)


def assert_no_load_left(gw: RunningGateway) -> None:
    """Every attempt of every tier ended: no replica still counts one outstanding (a small
    answer set aside at escalation once did, one per request, until routing and admission saw
    a saturated small tier)."""
    left = {r.name: r.outstanding for p in gw.runtime.pools.values() for r in p.replicas}
    assert set(left.values()) == {0}, left


@pytest.mark.parametrize(("threshold", "expected"), [(1.0, "small"), (-1.0, "large")])
async def test_commit_point_holds_tokens_until_the_verdict(
    make_fake: FakeFactory, make_gateway: GatewayFactory, threshold: float, expected: str
) -> None:
    small = await make_fake(chunks=6, chunk_interval_ms=5)
    large = await make_fake(chunks=2, reply="x")
    tier = {"mode": "cascade", "threshold": threshold, "commit": {"tokens": 3}}
    gw = await make_gateway(policy(small, large, **tier))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, stream=True
    )
    texts = [c.choices[0].delta.content async for c in raw.parse() if c.choices]
    assert raw.headers["x-gateway-tier"] == expected
    if expected == "small":
        assert texts == [f"tok{i} " for i in range(6)]  # held chunks released, rest relayed
    else:
        assert texts == ["tok0 ", "tok1 "]  # none of the small tokens reached the client
        assert small.fake.disconnected == 1  # the small stream was closed at the verdict


async def test_large_tier_failure_falls_back_to_the_small_answer(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply="maybe 12"), await make_fake()
    large.fake.queue("status:503", "status:503")
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=-1.0))
    raw = await gw.client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.headers["x-gateway-tier-fallback"] == "small"
    assert raw.parse().choices[0].message.content == "maybe 12"
    assert_no_load_left(gw)
    no_fallback = await make_gateway(
        policy(small, large, mode="cascade", threshold=-1.0, fallback_to_small=False)
    )
    large.fake.queue("status:503", "status:503")
    with pytest.raises(openai.APIStatusError) as info:
        await no_fallback.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert info.value.status_code == 502
    assert_no_load_left(no_fallback)


async def test_embeddings_on_a_tiered_alias_is_a_400(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(), await make_fake()
    gw = await make_gateway(policy(small, large, mode="route"))
    with pytest.raises(openai.BadRequestError) as err:
        await gw.client.embeddings.create(model="auto", input="hello")
    assert err.value.param == "model" and "tiered" in err.value.message
    assert small.fake.requests == [] and large.fake.requests == []


# --- the cascade goes through the one relay path: what holds for plain requests holds here ---

DEADLINE_SURFACE = {"default": {"budget": {"total_ms": 700}, "actions": {"deadline": True}}}


async def test_a_cascade_honours_the_surface_deadline(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A kept small answer that would stream for 2 s is ended at total_ms (700 ms)."""
    small = await make_fake(chunks=20, chunk_interval_ms=100)
    large = await make_fake()
    tier = {"mode": "cascade", "threshold": 1.0, "commit": {"tokens": 4}}
    gw = await make_gateway(policy(small, large, DEADLINE_SURFACE, **tier))
    started = time.perf_counter()
    stream = await gw.client.chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    chunks = [c async for c in stream]
    elapsed = time.perf_counter() - started
    assert elapsed < 1.2, elapsed
    assert chunks[-1].choices[0].finish_reason == "length"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert 4 <= len(texts) < 20  # the held chunks, then the relay until the deadline
    assert await metric([gw], "llm_gateway_deadline_stops_total", surface="default") == 1


async def test_a_cascade_stream_with_parallel_tool_calls_passes_the_sdk_stream_helper(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A held (whole) small answer is re-encoded with each tool call's index, so the SDK's
    accumulator keeps parallel calls apart; the same through a cascade that escalated."""
    small = await make_fake(reply="Checking both.", tool_calls=2)
    large = await make_fake(reply="x", tool_calls=2, chunks=2)
    for threshold, tier in ((1.0, "small"), (-1.0, "large")):
        gw = await make_gateway(policy(small, large, mode="cascade", threshold=threshold))
        async with gw.client.chat.completions.stream(
            model="auto", messages=MESSAGES, tools=TOOLS
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        calls = final.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == ["tool_0", "tool_1"], tier
        assert [json.loads(c.function.arguments) for c in calls] == [
            {"city": "city-0"},
            {"city": "city-1"},
        ]
        assert final.choices[0].finish_reason == "tool_calls"


async def test_a_cascade_records_inter_token_gaps_the_span_summary_and_fills_the_cache(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small = await make_fake(chunks=6, chunk_interval_ms=5)
    large = await make_fake()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    tier = {"mode": "cascade", "threshold": 1.0, "commit": {"tokens": 2}}
    cached = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(policy(small, large, cached, **tier), telemetry=telemetry)
    request: Any = {"model": "auto", "messages": MESSAGES, "stream": True, "temperature": 0}
    texts = [
        c.choices[0].delta.content
        async for c in await gw.client.chat.completions.create(**request)
        if c.choices
    ]
    assert texts == [f"tok{i} " for i in range(6)]
    # inter-token gaps of the small tier's replica were observed for the alias
    assert await metric([gw], "llm_gateway_inter_token_latency_seconds_count", model="auto") >= 1
    # the span carries the answer's summary (read from the relayed stream)
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("chat ")]
    assert spans and spans[-1].attributes is not None
    assert spans[-1].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert spans[-1].attributes["gateway.cascade.escalated"] is False
    # the complete answer was captured and stored: the same request is now an exact hit
    assert gw.runtime.cache is not None
    await gw.runtime.cache.drain()
    raw = await gw.client.chat.completions.with_raw_response.create(**request)
    assert raw.headers["x-gateway-cache"] == "exact"
    assert len(small.fake.requests) == 1


TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("tool_0", "tool_1")
]


@pytest.mark.parametrize("commit", [{"tokens": "whole"}, {"tokens": 2}])
async def test_a_tool_call_from_the_small_tier_is_an_answer_kept_like_any(
    make_fake: FakeFactory, make_gateway: GatewayFactory, commit: Any
) -> None:
    """A valid tool call (content null) is a complete answer, never "empty": with a threshold
    that keeps every answer, it is kept, whole or streamed, and the large tier is never asked
    (at a commit point of N, the tool call's deltas are the chunks held and judged)."""
    small, large = await make_fake(), await make_fake()
    small.fake.queue("tool_call", "tool_call")
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=1.0, commit=commit))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, tools=TOOLS
    )
    assert raw.headers["x-gateway-cascade"] == "kept"
    calls: Any = raw.parse().choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["tool_0"]
    streamed = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, tools=TOOLS, stream=True
    )
    assert streamed.headers["x-gateway-cascade"] == "kept"
    chunks = [c async for c in streamed.parse()]
    names = [
        t.function.name
        for c in chunks
        if c.choices
        for t in c.choices[0].delta.tool_calls or []
        if t.function is not None and t.function.name
    ]
    assert names == ["tool_0"]
    assert large.fake.requests == []
    assert await metric([gw], "llm_gateway_tier_decisions_total", outcome="kept") == 2


PRICED_TIERS: Any = [
    {"backend": "small", "price": {"input_per_mtok": 1, "output_per_mtok": 2}},
    {
        "backend": "large",
        "model": "big-model",
        "price": {"input_per_mtok": 10, "output_per_mtok": 20},
    },
]


async def test_an_escalation_is_counted_paid_and_traced_whatever_the_large_tier_does(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The small answer read whole and escalated is paid (cost and tokens) and the escalation
    counted and on the span before the large tier is asked: when it then fails too, and when
    it answers (the span names the tier that answered)."""
    small = await make_fake(reply="I am not sure.", prompt_tokens=10, completion_tokens=4)
    large = await make_fake(reply="#### 12", prompt_tokens=20, completion_tokens=2)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    tier = {"mode": "cascade", "threshold": -1.0, "fallback_to_small": False}
    gw = await make_gateway(policy(small, large, tiers=PRICED_TIERS, **tier), telemetry=telemetry)
    large.fake.queue("status:503")
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert info.value.status_code == 502
    assert await metric([gw], "llm_gateway_tier_decisions_total", outcome="escalated") == 1
    # 10 input and 4 output tokens at 1 and 2 $/Mtok
    assert await metric([gw], "llm_gateway_cost_usd_total", model="auto") == pytest.approx(18e-6)
    assert await metric([gw], "llm_gateway_tokens_total", kind="input") == 10
    assert await metric([gw], "llm_gateway_tokens_total", kind="output") == 4
    failed = _request_spans(exporter)[-1]
    assert failed["gateway.cascade.escalated"] is True
    assert failed["gateway.tier"] == "large"  # asked, and failed
    # Answered by the large tier: both answers paid, both counted in tokens.
    await gw.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert await metric([gw], "llm_gateway_tier_decisions_total", outcome="escalated") == 2
    cost = (18 + 18 + 20 * 10 + 2 * 20) * 1e-6  # both small answers, and the large one
    assert await metric([gw], "llm_gateway_cost_usd_total", model="auto") == pytest.approx(cost)
    assert await metric([gw], "llm_gateway_tokens_total", kind="input") == 10 + 10 + 20
    assert await metric([gw], "llm_gateway_tokens_total", kind="output") == 4 + 4 + 2
    assert _request_spans(exporter)[-1]["gateway.tier"] == "large"


async def test_a_large_tier_failure_served_by_the_small_answer_is_traced_as_small(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small = await make_fake(reply="maybe 12", prompt_tokens=10, completion_tokens=4)
    large = await make_fake()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    gw = await make_gateway(
        policy(small, large, tiers=PRICED_TIERS, mode="cascade", threshold=-1.0),
        telemetry=telemetry,
    )
    large.fake.queue("status:503")
    raw = await gw.client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.headers["x-gateway-tier-fallback"] == "small"
    assert raw.headers["x-gateway-cost-usd"] == "0.000018"  # served once, paid once
    span = _request_spans(exporter)[-1]
    assert span["gateway.tier"] == "small" and span["gateway.tier.fallback"] is True
    assert await metric([gw], "llm_gateway_tokens_total", kind="output") == 4


async def test_a_cut_the_callers_max_tokens_made_is_not_escalated_for_it(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """``finish_reason: length`` forces an escalation, unless the caller's own ``max_tokens``
    cut the answer: the large tier would be cut there too, and the caller would pay both."""
    small, large = await make_fake(reply="12", finish_reason="length"), await make_fake()
    gw = await make_gateway(policy(small, large, mode="cascade", threshold=1.0))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="auto", messages=MESSAGES, max_tokens=1
    )
    assert raw.headers["x-gateway-cascade"] == "kept"
    assert raw.parse().choices[0].finish_reason == "length"
    assert large.fake.requests == []
    raw = await gw.client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.headers["x-gateway-cascade"] == "escalated"  # cut by the model's own limit


async def test_a_streamed_whole_cascade_past_total_ms_before_any_byte_is_a_504(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """With ``commit: whole`` the client's first byte is the small answer's end: a deadline
    that passes before it is a 504, as for any request before its first byte (README)."""
    small, large = await make_fake(latency_ms=1500), await make_fake()
    surfaces = {"default": {"budget": {"total_ms": 300}, "actions": {"deadline": True}}}
    gw = await make_gateway(policy(small, large, surfaces, mode="cascade", threshold=1.0))
    started = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="auto", messages=MESSAGES, stream=True)
    assert info.value.status_code == 504
    assert time.perf_counter() - started < 1.0
    assert large.fake.requests == []


def _request_spans(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("chat ")]
    return [dict(s.attributes or {}) for s in spans]


def _attempt_spans(exporter: InMemorySpanExporter) -> dict[str, Any]:
    """The upstream attempts' CLIENT spans, by backend (one per backend here)."""
    return {
        str((s.attributes or {})["gateway.backend"]): s
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.CLIENT
    }


async def test_an_escalated_small_answer_is_lost_and_ends_when_it_was_judged(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The small answer read whole and escalated is ``lost`` (README), not ``ok``: its span and
    the attempts metric say so, and its span ends at the verdict, before the large tier was
    asked (it once ran on until the large tier's headers came). A small answer served after
    all (the large tier failed: the fallback) is the answer: ``ok``."""
    small = await make_fake(reply="I am not sure.")
    large = await make_fake(reply="#### 12", latency_ms=200)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    gw = await make_gateway(
        policy(small, large, mode="cascade", threshold=-1.0), telemetry=telemetry
    )
    r = await gw.client.chat.completions.create(model="auto", messages=MESSAGES)
    assert r.choices[0].message.content == "#### 12"
    spans = _attempt_spans(exporter)
    lost, answered = spans["small"], spans["large"]
    assert lost.attributes is not None and answered.attributes is not None
    assert lost.attributes["gateway.attempt.outcome"] == "lost"
    assert answered.attributes["gateway.attempt.outcome"] == "ok"
    assert lost.end_time is not None and answered.start_time is not None
    assert lost.end_time <= answered.start_time
    small_attempts = "llm_gateway_upstream_attempts_total"
    assert await metric([gw], small_attempts, backend="small", outcome="lost") == 1
    assert await metric([gw], small_attempts, backend="small", outcome="ok") == 0
    assert_no_load_left(gw)
    exporter.clear()
    large.fake.queue("status:503")
    raw = await gw.client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES)
    assert raw.headers["x-gateway-tier-fallback"] == "small"
    served = _attempt_spans(exporter)["small"].attributes
    assert served is not None and served["gateway.attempt.outcome"] == "ok"
    assert_no_load_left(gw)


async def test_a_kept_whole_cascade_stream_traces_its_usage_without_include_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A streamed request whose small answer was read whole and kept records the answer's
    usage on its span whether or not the client asked for the usage chunk (as a live stream
    does: the gateway asks every stream for it); the client gets it only if it asked."""
    small = await make_fake(reply=GOOD, prompt_tokens=11, completion_tokens=7)
    large = await make_fake()
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    gw = await make_gateway(
        policy(small, large, mode="cascade", threshold=1.0), telemetry=telemetry
    )
    for asked in (False, True):
        options: Any = {"stream_options": {"include_usage": True}} if asked else {}
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="auto", messages=MESSAGES, stream=True, **options
        )
        assert raw.headers["x-gateway-cascade"] == "kept"
        chunks = [c async for c in raw.parse()]
        assert (chunks[-1].usage is not None) is asked
        assert all(c.usage is None for c in chunks[:-1])
        span = _request_spans(exporter)[-1]
        assert span["gen_ai.usage.input_tokens"] == 11, asked
        assert span["gen_ai.usage.output_tokens"] == 7, asked
        assert span["gen_ai.response.finish_reasons"] == ("stop",)
    assert large.fake.requests == []
