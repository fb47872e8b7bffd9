"""Usage and cost through the real gateway: streams (the usage chunk asked for and taken out
again), cache hits (zero upstream tokens), cached input priced apart, the usage report, and
providers' rate limits (429 to a fallback, pacing)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.tracing import Telemetry
from policies.server import TelemetryConfig
from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, vllm
from tests.e2e.limits_helpers import (
    MESSAGES,
    PRICE,
    chat,
    client,
    limits_policy,
    metric,
    settled,
    usage_report,
)
from tests.gateway.limits.conftest import Clock

Clients = Callable[..., openai.AsyncOpenAI]


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    made: list[openai.AsyncOpenAI] = []

    def make(gw: RunningGateway, tenant: str = "team-a") -> openai.AsyncOpenAI:
        made.append(client(gw, tenant))
        return made[-1]

    yield make
    for c in made:
        await c.close()


async def stream_chunks(c: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list[Any], dict[str, str]]:
    raw = await c.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, stream=True, **kwargs
    )
    chunks = [chunk async for chunk in raw.parse()]
    return chunks, dict(raw.headers)


async def test_streams_are_metered_on_their_real_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake(chunks=7)  # usage: 5 prompt tokens, 7 completion tokens
    rules = {"limits": {"tokens_per_minute": 10_000}}
    gw = await make_gateway(limits_policy(fake.url, None, rules), clock=Clock())
    chunks, headers = await stream_chunks(clients(gw), max_tokens=100)
    # The client did not ask for usage: the gateway asked for it upstream and took it out.
    assert fake.fake.requests[-1].body["stream_options"] == {"include_usage": True}
    assert all(c.usage is None and c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("tok0 tok1")
    assert "x-gateway-cost-usd" not in headers  # a live stream's headers leave before its usage
    await settled(gw)
    # A client that asks gets the usage chunk, as the upstream sent it.
    chunks, _ = await stream_chunks(clients(gw), stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    await settled(gw)
    gateways = [gw]
    assert await metric(gateways, "llm_gateway_tokens_total", kind="output") == 14
    assert await metric(gateways, "llm_gateway_tokens_total", kind="input") == 10
    cost = await metric(gateways, "llm_gateway_cost_usd_total", tenant="team-a")
    assert cost == pytest.approx(2 * (5 * 1000 + 7 * 2000) / 1e6)
    # The reservation (prompt estimate + 100) was reconciled to the 12 real tokens each time.
    _, headers, _ = await chat(clients(gw), max_tokens=100)
    reserved_now = 10_000 - int(headers["x-ratelimit-remaining-tokens"])
    assert reserved_now < 2 * 12 + 110


async def test_cache_hits_cost_zero_upstream_tokens(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake()
    surfaces = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(limits_policy(fake.url, None, {}, surfaces=surfaces), clock=Clock())
    status, first, _ = await chat(clients(gw), temperature=0)
    assert status == 200 and first["x-gateway-cache"] == "miss"
    assert first["x-gateway-cost-usd"] == "0.017"
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    status, hit, reply = await chat(clients(gw), temperature=0)
    assert hit["x-gateway-cache"] == "exact" and hit["x-gateway-cost-usd"] == "0"
    assert reply.usage.total_tokens == 0
    chunks, headers = await stream_chunks(clients(gw), temperature=0)
    assert headers["x-gateway-cache"] == "exact" and headers["x-gateway-cost-usd"] == "0"
    assert all(c.usage is None for c in chunks)  # a replayed stream: no usage chunk unasked
    assert len(fake.fake.requests) == 1
    await settled(gw)
    g = [gw]
    assert await metric(g, "llm_gateway_tenant_requests_total", source="cache") == 2
    assert await metric(g, "llm_gateway_tenant_requests_total", source="upstream") == 1
    assert await metric(g, "llm_gateway_tokens_total", tenant="team-a") == 11
    status, report = await usage_report(gw, tenant="team-a", window="day")
    row = report["surfaces"]["default"]
    assert (row["requests"], row["cache_hits"], row["cost_usd"]) == (3, 2, "0.017")
    assert row["cost_per_1k_requests_usd"] == "5.666666666666"  # 0.017 x 1000 / 3, floored
    assert row["tokens"] == {"input": 5, "cached_input": 0, "output": 6}


async def test_cached_input_is_priced_apart(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake(prompt_tokens=100, cached_tokens=80, completion_tokens=10)
    gw = await make_gateway(limits_policy(fake.url, None, {}), clock=Clock())
    _, headers, reply = await chat(clients(gw))
    # 20 x 1000 + 80 x 250 + 10 x 2000 per Mtok
    assert headers["x-gateway-cost-usd"] == "0.06"
    assert reply.usage.prompt_tokens_details.cached_tokens == 80
    await settled(gw)
    assert await metric([gw], "llm_gateway_tokens_total", kind="cached_input") == 80


async def test_usage_report_across_instances(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    fake = await make_fake()
    budget = {"usd": 1, "window": "month"}
    surfaces = {"chat": {"match": {"header": "chat"}}, "batch": {"match": {"header": "batch"}}}
    policy = limits_policy(fake.url, redis_server.url, {"budget": budget}, surfaces=surfaces)
    gateways = [await make_gateway(policy) for _ in range(3)]
    for i in range(6):
        surface = "chat" if i < 4 else "batch"
        status, _, _ = await chat(clients(gateways[i % 3]), extra_headers={"X-Surface": surface})
        assert status == 200
    await settled(*gateways)
    status, report = await usage_report(gateways[2], tenant="team-a", window="month")
    assert status == 200
    assert (report["spend_usd"], report["budget_usd"], report["remaining_usd"]) == (
        "0.102", "1", "0.898")  # fmt: skip
    assert report["requests"] == 6 and report["tokens"]["output"] == 36
    chat_row = report["surfaces"]["chat"]
    assert chat_row["requests"] == 4 and chat_row["cost_per_1k_requests_usd"] == "17"
    assert chat_row["latency_ms"]["total_ms"]  # this instance's percentiles, beside the cost
    status, everyone = await usage_report(gateways[0], window="day")
    assert [t["tenant"] for t in everyone["tenants"]] == ["team-a", "team-b"]
    assert (await usage_report(gateways[0], tenant="nobody"))[0] == 404
    assert (await usage_report(gateways[0], window="year"))[0] == 400


async def test_a_providers_429_goes_to_the_fallback_and_is_not_a_failure(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    primary, fallback = await make_fake(reply="primary"), await make_fake(reply="fallback")
    backends = {
        "api": {"kind": "openai", "base_url": primary.url, "health": {"eject_after": 1}},
        "spare": {"kind": "openai", "base_url": fallback.url},
    }
    models = {"m": {"backend": "api", "price": PRICE, "fallbacks": ["spare"]}}
    gw = await make_gateway(
        limits_policy(primary.url, None, {}, models=models, backends=backends), clock=Clock()
    )
    primary.fake.queue("ratelimit:0.05")
    status, headers, reply = await chat(clients(gw))
    assert status == 200 and reply.choices[0].message.content == "fallback"
    assert "x-ratelimit-remaining-requests" not in headers  # the provider's account state stays
    assert gw.runtime.pools["api"].replicas[0].healthy  # a 429 is not the upstream being down
    assert await metric([gw], "llm_gateway_upstream_rate_limited_total", backend="api") == 1
    await asyncio.sleep(0.06)
    status, _, reply = await chat(clients(gw))
    assert reply.choices[0].message.content == "primary"
    # Every target limited: the last one's 429 reaches the client as the provider sent it
    # (without the provider's account headers), saying when to come back.
    primary.fake.queue("ratelimit:3")
    fallback.fake.queue("ratelimit:5")
    status, headers, body = await chat(clients(gw))
    assert status == 429 and body["code"] == "rate_limit_exceeded"
    assert headers["retry-after-ms"] == "5000" and "x-ratelimit-remaining-requests" not in headers
    assert await metric([gw], "llm_gateway_upstream_rate_limited_total") == 3
    # Both providers asked to wait longer than the backends' rate_limit_wait_s (2 s): the next
    # request is not sent into a certain 429, the gateway answers it.
    status, headers, body = await chat(clients(gw))
    assert status == 429 and body["type"] == "rate_limit_exceeded"
    assert headers["retry-after"] == "3" and len(fallback.fake.requests) == 2


async def test_requests_wait_for_a_spent_provider_budget_to_reset(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    # Spent for 1 s: a loaded machine's second request comes well inside it (with 300 ms, a
    # stressed run's came 250 ms after the first's answer: it waited 0.05 s).
    spent = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}
    fake = await make_fake(headers=spent)
    backends = {"api": {"kind": "openai", "base_url": fake.url, "rate_limit_wait_s": 2}}
    models = {"m": {"backend": "api", "price": PRICE}}
    gw = await make_gateway(
        limits_policy(fake.url, None, {}, models=models, backends=backends), clock=Clock()
    )
    assert (await chat(clients(gw)))[0] == 200  # learns the budget is spent until +1 s
    answered = time.perf_counter()
    assert (await chat(clients(gw)))[0] == 200
    assert time.perf_counter() - answered >= 0.4  # paced, not sent into a certain 429
    g = [gw]
    waited = await metric(g, "llm_gateway_upstream_rate_limit_wait_seconds_sum", backend="api")
    assert 0.4 <= waited <= 1.0  # the rest of the 1 s when the second request came
    assert await metric(g, "llm_gateway_upstream_rate_limit_wait_seconds_count") == 1


async def test_the_span_carries_cost_and_time_waiting_for_a_provider(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    # Spent for 1 s: the second request comes inside it even on a loaded machine (with 200 ms
    # a stressed run's came after it: no wait to report).
    spent = {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1s"}
    fake = await make_fake(headers=spent, cached_tokens=2)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.from_config(
        TelemetryConfig(enabled=True, sample_ratio=1.0), exporter=exporter, batch=False
    )
    gw = await make_gateway(limits_policy(fake.url, None, {}), clock=Clock(), telemetry=telemetry)
    for _ in range(2):
        assert (await chat(clients(gw)))[0] == 200
    await settled(gw)
    roots = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert len(roots) == 2
    first, second = (dict(s.attributes or {}) for s in roots)
    # 3 x 1000 + 2 x 250 + 6 x 2000 per Mtok
    assert first["gateway.cost.usd"] == pytest.approx(0.0155)
    assert first["gateway.usage.cached_input_tokens"] == 2
    assert "gateway.upstream.rate_limit_wait_ms" not in first
    assert 400 <= float(second["gateway.upstream.rate_limit_wait_ms"]) <= 1000  # type: ignore[arg-type]


async def test_an_upstream_without_usage_is_charged_the_estimate(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake(report_usage=False)
    gw = await make_gateway(limits_policy(fake.url, None, {}), clock=Clock())
    _, headers, _ = await chat(clients(gw), max_tokens=20)
    # "Say hello." is 10 characters: 3 tokens and 4 for the message; 20 for max_tokens.
    assert headers["x-gateway-cost-usd"] == "0.047"  # 7 x 1000 + 20 x 2000 per Mtok
    await settled(gw)
    assert await metric([gw], "llm_gateway_tokens_total", kind="output") == 20


async def test_a_client_leaving_mid_stream_is_charged_what_it_was_sent(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake(chunks=50, chunk_interval_ms=20)
    gw = await make_gateway(limits_policy(fake.url, None, {}), clock=Clock())
    raw = await clients(gw).chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, stream=True
    )
    stream = raw.parse()
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 5:
            break
    await stream.close()
    for _ in range(200):  # the gateway notices the close, then settles
        await settled(gw)
        out = await metric([gw], "llm_gateway_tokens_total", kind="output")
        if out:
            break
        await asyncio.sleep(0.02)
    assert 5 <= out < 50  # the events it was sent, not the whole answer nor nothing
    assert fake.fake.disconnected == 1


async def test_answers_the_gateway_failed_after_the_upstream_answered_are_charged(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    """The upstream generated them (a provider bills them): an answer over max_response_bytes
    is charged its whole estimate, one whose body was still coming at total_s its prompt's; a
    failure before any answer (the replica's 503) gives everything back."""
    fake = await make_fake()
    backends = {"up": vllm(fake.url, timeouts={"first_byte_s": 0.3, "total_s": 0.3})}
    policy = limits_policy(
        fake.url,
        None,
        {"limits": {"tokens_per_minute": 10_000}},
        backends=backends,
        server={"max_response_bytes": 4096},
    )
    gw = await make_gateway(policy, clock=Clock())
    c = clients(gw)
    fake.fake.queue("big:20000", "stall_body", "status:503")
    status, headers, body = await chat(c, max_tokens=20)
    assert status == 502 and body["code"] == "response_too_large"
    assert headers["x-ratelimit-remaining-tokens"] == str(10_000 - 27)  # 7 prompt + 20 output
    status, _, body = await chat(c, max_tokens=20)
    assert status == 504 and body["code"] == "total_timeout"
    status, _, _ = await chat(c, max_tokens=20)
    assert status == 502
    await settled(gw)
    _, report = await usage_report(gw, tenant="team-a", window="day")
    assert report["requests"] == 2
    assert report["tokens"] == {"input": 14, "cached_input": 0, "output": 20}
    assert report["spend_usd"] == "0.054"  # 0.047 (7 x 1000 + 20 x 2000 per Mtok) + 0.007
    status, headers, _ = await chat(c, max_tokens=20)
    assert status == 200  # the 27 + 7 charged are held, and this request's 27
    assert headers["x-ratelimit-remaining-tokens"] == str(10_000 - 27 - 7 - 27)


async def test_a_client_leaving_before_the_answer_is_charged_its_prompt_at_its_price(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    """As a client leaving mid-stream is: priced (the first target's price, no attempt having
    opened), not counted in tokens at no cost."""
    fake = await make_fake()
    gw = await make_gateway(
        limits_policy(fake.url, None, {"budget": {"usd": 1, "window": "day"}}), clock=Clock()
    )
    fake.fake.queue("hang")
    leaving = clients(gw).with_options(timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        await leaving.chat.completions.create(model="m", messages=MESSAGES)
    for _ in range(200):  # the gateway notices the close, then settles
        await settled(gw)
        _, report = await usage_report(gw, tenant="team-a", window="day")
        if report["requests"]:
            break
        await asyncio.sleep(0.02)
    assert report["tokens"]["input"] == 7 and report["tokens"]["output"] == 0
    assert report["spend_usd"] == "0.007"  # 7 x 1000 per Mtok
