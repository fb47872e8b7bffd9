"""The gateway's stages on the Responses and Messages APIs: the deadline, broken streams, the
cache, tiers and cascades, metrics, each seen from the official clients."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy
from tests.e2e.test_tiers_e2e import GOOD, MESSAGES
from tests.e2e.test_tiers_e2e import policy as tier_policy

DEADLINE = """
surfaces:
  chat:
    match: {header: chat}
    budget: {total_ms: 300}
    actions: {deadline: true}
"""
HELLO: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture
async def claude_of() -> AsyncIterator[Any]:
    clients: list[anthropic.AsyncAnthropic] = []

    def make(gw: RunningGateway) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(base_url=gw.root, api_key="x", max_retries=0)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def statuses(gw: RunningGateway) -> list[str]:
    async with aiohttp.ClientSession() as session:
        text = await (await session.get(gw.root + "/metrics")).text()
    return [
        line.split('status="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("llm_gateway_requests_total{")
    ]


async def test_the_deadline_ends_a_responses_stream_as_incomplete(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=200, chunk_interval_ms=20)
    gw = await make_gateway(pool_policy([up.url], DEADLINE))
    t0 = time.perf_counter()
    stream = await gw.client.responses.create(
        model="m", input="Hi", stream=True, extra_headers={"X-Surface": "chat"}
    )
    events = [event async for event in stream]
    assert time.perf_counter() - t0 < 1.5
    last = events[-1]
    assert last.type == "response.incomplete"  # as OpenAI ends a response at its token limit
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert 0 < len(last.response.output_text.split()) < 100
    usage = last.response.usage  # what the gateway charges, not zero
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0


async def test_the_deadline_ends_a_messages_stream_at_max_tokens(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude_of: Any
) -> None:
    up = await make_fake(chunks=200, chunk_interval_ms=20)
    gw = await make_gateway(pool_policy([up.url], DEADLINE))
    async with claude_of(gw).messages.stream(
        model="m", max_tokens=500, messages=HELLO, extra_headers={"X-Surface": "chat"}
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.content and final.content[0].type == "text"
    assert final.usage.output_tokens > 0  # what the gateway charges, not zero


async def test_a_deadline_before_the_first_token_is_504_in_each_dialect(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude_of: Any
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url], DEADLINE))
    up.fake.queue("ttft:3", "ttft:3")
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.responses.create(
            model="m", input="Hi", stream=True, extra_headers={"X-Surface": "chat"}
        )
    assert info.value.status_code == 504
    with pytest.raises(anthropic.APIStatusError) as claude_info:
        async with claude_of(gw).messages.stream(
            model="m", max_tokens=500, messages=HELLO, extra_headers={"X-Surface": "chat"}
        ) as stream:
            await stream.get_final_message()
    assert claude_info.value.status_code == 504
    body = claude_info.value.body
    assert isinstance(body, dict) and body["type"] == "error"  # Anthropic's error shape


async def test_a_stream_broken_midway_fails_in_each_dialect(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude_of: Any
) -> None:
    up = await make_fake(chunks=6)
    gw = await make_gateway(pool_policy([up.url]))
    up.fake.queue("midstream_drop")
    events = [e async for e in await gw.client.responses.create(model="m", input="x", stream=True)]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    up.fake.queue("midstream_drop")
    with pytest.raises(anthropic.APIStatusError):
        async with claude_of(gw).messages.stream(model="m", max_tokens=9, messages=HELLO) as s:
            async for _ in s:
                pass
    assert sorted(await statuses(gw)) == ["502"]  # both counted as broken streams
    await gw.client.responses.create(model="m", input="stored?")  # the store is still fine


async def test_a_cache_hit_in_the_messages_api_reports_no_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude_of: Any
) -> None:
    up = await make_fake(cached_tokens=2)
    surfaces = "surfaces:\n  default:\n    cache: {exact: true}\n"
    gw = await make_gateway(pool_policy([up.url], surfaces))
    client = claude_of(gw)
    greedy: Any = {"temperature": 0}  # only greedy answers are cached
    first = await client.messages.create(
        model="m", max_tokens=20, messages=HELLO, extra_body=greedy
    )
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens) == (3, 2)
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    raw = await client.messages.with_raw_response.create(
        model="m", max_tokens=20, messages=HELLO, extra_body=greedy
    )
    again = await raw.parse()
    assert raw.headers["x-gateway-cache"] == "exact" and len(up.fake.requests) == 1
    assert again.content == first.content
    assert (again.usage.input_tokens, again.usage.output_tokens) == (0, 0)
    assert again.usage.cache_read_input_tokens == 0
    async with client.messages.stream(
        model="m", max_tokens=20, messages=HELLO, extra_body=greedy
    ) as stream:
        streamed = await stream.get_final_message()
    texts = [b.text for b in streamed.content if b.type == "text"]
    assert texts == ["hello from the fake upstream"] and len(up.fake.requests) == 1
    # the chat API shares the entry: the same request in another dialect
    chat = await gw.client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=20, temperature=0
    )
    assert chat.choices[0].message.content == "hello from the fake upstream"
    assert len(up.fake.requests) == 1


async def test_tiers_and_a_cascade_serve_the_responses_api(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply=GOOD), await make_fake(reply="large")
    routed = await make_gateway(tier_policy(small, large, mode="route", threshold=-1.0))
    raw = await routed.client.responses.with_raw_response.create(
        model="auto", input=MESSAGES[0]["content"]
    )
    assert raw.headers["x-gateway-tier"] == "large"
    assert raw.parse().output_text == "large"
    cascade = await make_gateway(tier_policy(small, large, mode="cascade", threshold=1.0))
    async with cascade.client.responses.stream(
        model="auto", input=MESSAGES[0]["content"]
    ) as stream:
        kept = await stream.get_final_response()
    assert kept.output_text == GOOD  # the held small answer, re-told as Responses events
    assert kept.usage is not None and kept.usage.output_tokens == 6


async def test_unknown_routes_and_methods_stay_errors(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    with pytest.raises(openai.NotFoundError):
        await gw.client.responses.retrieve("resp_does_not_exist")
    async with aiohttp.ClientSession() as session:
        r = await session.post(gw.root + "/v1/responses", data=b"{not json")
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await session.post(gw.root + "/v1/messages", data=b"[]")
        body = await r.json()
        assert r.status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        r = await session.get(gw.base_url + "/responses/x/input_items?limit=1000")
        assert r.status == 404  # unknown id first
    assert up.fake.requests == []
