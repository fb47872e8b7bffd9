"""Budget enforcement and tracing through the real gateway, each action on its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.tracing import Telemetry
from policies.server import TelemetryConfig
from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    build_policy,
    closed_port_url,
    pool_policy,
    vllm,
)

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def policy(urls: list[str], surfaces: str, extra: str = "") -> str:
    return pool_policy(urls, f"surfaces:\n{surfaces}\n{extra}")


async def test_priority_admission_serves_interactive_first(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(latency_ms=150)
    surfaces = """
  chat: {match: {header: chat}, priority: interactive, budget: {ttft_ms: 5000}}
  batch: {match: {header: batch}, priority: background}
"""
    gw = await make_gateway(
        policy([up.url], surfaces, "admission: {max_outstanding_per_replica: 1, aging_s: 60}")
    )

    async def ask(surface: str, tag: str) -> None:
        await gw.client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": tag}],
            extra_headers={"X-Surface": surface},
        )

    queue = gw.runtime.pools["up"].admission
    assert queue is not None

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached")

    first = asyncio.create_task(ask("batch", "b0"))  # takes the only slot
    await until(lambda: up.fake.active == 1)
    queued = [asyncio.create_task(ask("batch", f"b{i}")) for i in (1, 2)]
    await until(lambda: queue.waiting == 2)
    queued.append(asyncio.create_task(ask("chat", "i1")))  # arrives last
    await until(lambda: queue.waiting == 3)
    await asyncio.gather(first, *queued)
    order = [r.body["messages"][0]["content"] for r in up.fake.requests]
    assert order == ["b0", "i1", "b1", "b2"]
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/admin/surfaces") as r:
        view = await r.json()
    assert view["surfaces"]["chat"]["requests"] == 1
    assert view["surfaces"]["batch"]["requests"] == 3


async def test_queued_past_budget_gets_503_with_retry_after(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(latency_ms=600)
    surfaces = "  chat: {match: {header: chat}, priority: interactive, budget: {ttft_ms: 100}}"
    gw = await make_gateway(
        policy([up.url], surfaces, "admission: {max_outstanding_per_replica: 1}")
    )
    blocker = asyncio.create_task(gw.client.chat.completions.create(model="m", messages=MESSAGES))
    for _ in range(500):
        if up.fake.active:
            break
        await asyncio.sleep(0.01)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES},
            headers={"X-Surface": "chat"},
        ) as r,
    ):
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "budget_exceeded"
    await blocker  # the admitted request still completes
    assert len(up.fake.requests) == 1


async def test_hedge_wins_against_a_slow_replica_and_cancels_it(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    # The hedge waits 500 ms: a loaded machine's fast replica answers within it, so only the
    # request on the slow one (3 s) is hedged.
    slow = await make_fake(latency_ms=3000, chunks=3)
    fast = await make_fake(chunks=3)
    surfaces = """
  chat:
    match: {header: chat}
    budget: {ttft_ms: 1000}
    actions: {hedge: {enabled: true, delay_ms: 500, max_fraction: 1.0}}
"""
    gw = await make_gateway(policy([slow.url, fast.url], surfaces))
    outcomes = []
    for _ in range(2):  # idle replicas take turns, so one request starts on the slow one
        t0 = time.perf_counter()
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
        )
        texts = [c.choices[0].delta.content async for c in raw.parse() if c.choices]
        outcomes.append((raw.headers.get("x-gateway-hedge"), time.perf_counter() - t0, texts))
    hedged = [o for o in outcomes if o[0] is not None]
    assert len(hedged) == 1
    assert hedged[0][0] == "hedge"
    assert hedged[0][1] < 2.0  # did not wait for the slow replica's 3 s
    assert hedged[0][2] == ["tok0 ", "tok1 ", "tok2 "]
    for _ in range(100):
        if slow.fake.active == 0:
            break
        await asyncio.sleep(0.01)
    assert slow.fake.disconnected == 1  # the losing attempt was closed upstream
    assert gw.runtime.pools["up"].replicas[0].outstanding == 0


async def test_deadline_ends_a_stream_with_finish_reason_length(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=200, chunk_interval_ms=20)
    surfaces = """
  chat:
    match: {header: chat}
    budget: {total_ms: 300}
    actions: {deadline: true}
"""
    gw = await make_gateway(policy([up.url], surfaces))
    t0 = time.perf_counter()
    stream = await gw.client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
    )
    chunks = [c async for c in stream]
    elapsed = time.perf_counter() - t0
    assert chunks[-1].choices[0].finish_reason == "length"
    assert 5 < len(chunks) < 100
    assert elapsed < 1.0
    # The stop chunk is the stream's own (its id and model), and a client that asked for
    # usage gets the usage the gateway charges (it had no usage chunk at all).
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[-1].model == chunks[0].model
    assert all(c.usage is None for c in chunks)
    stream = await gw.client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Surface": "chat"},
    )
    chunks = [c async for c in stream]
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens < 100
    for _ in range(100):
        if up.fake.active == 0:
            break
        await asyncio.sleep(0.01)
    assert up.fake.disconnected == 2


async def test_deadline_before_first_byte_is_504(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    surfaces = """
  chat:
    match: {header: chat}
    budget: {total_ms: 200}
    actions: {deadline: true}
"""
    gw = await make_gateway(policy([up.url], surfaces))
    up.fake.queue("hang")
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers={"X-Surface": "chat"}
        )
    assert info.value.status_code == 504
    assert time.perf_counter() - t0 < 1.0


async def test_deadline_before_the_first_token_of_a_stream_is_504(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """vLLM sends a stream's head at once and its first chunk with the first token: a stream
    whose first token comes after the deadline has no answer begun, so it is a 504 too (it was
    a 200 stream of one made-up chunk, with no id or model of the stream's own)."""
    up = await make_fake()
    surfaces = """
  chat:
    match: {header: chat}
    budget: {total_ms: 300}
    actions: {deadline: true}
"""
    gw = await make_gateway(policy([up.url], surfaces))
    up.fake.queue("ttft:3")
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
        )
    assert info.value.status_code == 504
    assert time.perf_counter() - t0 < 2.5
    for _ in range(200):  # the upstream request was closed, so vLLM would abort it
        if up.fake.active == 0:
            break
        await asyncio.sleep(0.01)
    assert up.fake.disconnected == 1
    # Its replica is not blamed: the deadline was the surface's, not a slow replica's.
    assert gw.runtime.pools["up"].replicas[0].consecutive_failures == 0


async def test_a_deadline_that_cuts_the_first_tokens_wait_never_blames_the_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The head came within the replica's first_byte_s and the deadline (total_ms above
    first_byte_s) then cut the wait for the first token: the 504 is the surface's, and three
    such requests ejected every replica (each later request a 503 no_healthy_replica)."""
    up = await make_fake(latency_ms=400)
    backend = vllm(up.url, timeouts={"first_byte_s": 1.0}, health={"eject_after": 3})
    surfaces = """surfaces:
  chat:
    match: {header: chat}
    budget: {total_ms: 1200}
    actions: {deadline: true}
"""
    gw = await make_gateway(build_policy({"up": backend}, {"m": {"backend": "up"}}, surfaces))
    for _ in range(3):
        up.fake.queue("ttft:3")
        with pytest.raises(openai.APIStatusError) as info:
            await gw.client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
            )
        assert info.value.status_code == 504
    replica = gw.runtime.pools["up"].replicas[0]
    assert replica.consecutive_failures == 0
    answer = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content


async def test_output_cap_lowers_max_tokens_to_fit_total(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=10, chunk_interval_ms=20)
    surfaces = """
  chat:
    match: {header: chat}
    budget: {total_ms: 200}
    actions: {cap_output: true}
"""
    gw = await make_gateway(policy([up.url], surfaces))
    warm = await gw.client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        max_tokens=10,
        extra_headers={"X-Surface": "chat"},
    )
    async for _ in warm:
        pass  # teaches the gateway this replica's inter-token latency (~20 ms)
    assert up.fake.requests[0].body["max_tokens"] == 10  # nothing known yet: unchanged
    await gw.client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=500, extra_headers={"X-Surface": "chat"}
    )
    capped = up.fake.requests[1].body["max_tokens"]
    assert 1 <= capped <= 11  # (200 ms - TTFT) / ~20 ms + 1
    await gw.client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=500)
    assert up.fake.requests[2].body["max_tokens"] == 500  # other surfaces are not capped


async def test_budget_routing_avoids_a_replica_predicted_to_miss(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    slow = await make_fake(latency_ms=300, chunks=2)
    fast = await make_fake(chunks=2)
    surfaces = """
  chat:
    match: {header: chat}
    budget: {ttft_ms: 150}
    actions: {budget_routing: true}
"""
    gw = await make_gateway(policy([slow.url, fast.url], surfaces))

    async def one(surface: str | None) -> None:
        headers = {"X-Surface": surface} if surface else {}
        s = await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, extra_headers=headers
        )
        async for _ in s:
            pass

    for _ in range(4):
        await one(None)  # both replicas observed
    before = len(slow.fake.requests)
    assert before == 2
    for _ in range(4):
        await one("chat")
    assert len(slow.fake.requests) == before  # every chat request went to the fast replica


async def test_unsampled_failed_request_is_still_traced(make_gateway: GatewayFactory) -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=0.0), {}, exporter=exporter, batch=False
    )
    surfaces = "  chat: {match: {header: chat}, priority: interactive}"
    gw = await make_gateway(policy([closed_port_url()], surfaces), telemetry=telemetry)
    with pytest.raises(openai.APIStatusError) as failure:
        await gw.client.with_options(max_retries=0).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Surface": "chat"},
        )
    assert failure.value.status_code >= 500
    spans = exporter.get_finished_spans()
    (span,) = [s for s in spans if s.parent is None]
    attrs = dict(span.attributes or {})
    assert attrs["gateway.trace.kept"] == "failure"
    assert attrs["gateway.surface"] == "chat"
    assert attrs["http.response.status_code"] == failure.value.status_code
    assert isinstance(attrs["error.type"], str) and attrs["error.type"]


async def test_unsampled_failed_request_keeps_its_attempts(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    ups = [await make_fake() for _ in range(2)]
    for up in ups:
        up.fake.queue("status:503")
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=0.0), {}, exporter=exporter, batch=False
    )
    surfaces = "  chat: {match: {header: chat}}"
    gw = await make_gateway(policy([u.url for u in ups], surfaces), telemetry=telemetry)
    with pytest.raises(openai.APIStatusError) as failure:
        await gw.client.with_options(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert failure.value.status_code == 502
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.parent is None]
    assert dict(root.attributes or {})["gateway.trace.kept"] == "failure"
    # both replicas were tried, each attempt under the request with why it failed
    attempts = [dict(s.attributes or {}) for s in spans if s.parent is not None]
    assert len(attempts) == 2
    assert {a["gateway.attempt.outcome"] for a in attempts} == {"http_5xx"}
    assert {a["server.port"] for a in attempts} == {int(u.url.rsplit(":", 1)[1][:-3]) for u in ups}


async def test_request_span_follows_genai_conventions_and_continues_the_trace(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=3)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), {}, exporter=exporter, batch=False
    )
    surfaces = "  chat: {match: {header: chat}, priority: interactive, budget: {ttft_ms: 1000}}"
    gw = await make_gateway(policy([up.url], surfaces), telemetry=telemetry)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    stream = await gw.client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "secret prompt"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Surface": "chat", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    async for _ in stream:
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat m"]
    attempt = spans["chat fake-model"]
    assert f"{root.context.trace_id:032x}" == trace_id  # the caller's trace continues
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.response.model"] == "fake-model"
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["stop"]  # type: ignore[arg-type]
    assert attrs["gateway.surface"] == "chat"
    assert attrs["gateway.priority"] == "interactive"
    assert attrs["gateway.replica"] == up.url.split("//")[1].removesuffix("/v1")
    assert "gateway.budget.ttft_headroom_ms" in attrs
    assert any(e.name == "first_token" for e in root.events)
    assert attempt.parent is not None and attempt.parent.span_id == root.context.span_id
    assert all(
        "secret prompt" not in str(v) for s in spans.values() for v in (s.attributes or {}).values()
    )
    sent = up.fake.requests[-1].headers["traceparent"]
    assert sent.split("-")[1] == trace_id  # and is passed upstream
    assert sent.split("-")[2] == f"{attempt.context.span_id:016x}"
    assert up.fake.requests[-1].headers["X-Vllm-Priority"] == "0"
