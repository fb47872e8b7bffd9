"""What an answer of a ``kind: anthropic`` backend is charged when its usage is not all there:
a Messages stream its client left before ``message_delta`` (whose ``message_start`` says
``output_tokens: 1`` of any answer), counts that are missing or malformed (charged the
estimate, through Messages passthrough as through chat and Responses translated, never a
zero), and an OpenAI usage without its output count."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway
from tests.e2e.anthropic_fake import OMIT
from tests.e2e.conftest import KEY_ENV, AnthropicFactory
from tests.e2e.limits_helpers import (
    KEYS,
    MESSAGES,
    PRICE,
    chat,
    client,
    limits_policy,
    metric,
    settled,
)
from tests.gateway.limits.conftest import Clock

# 600 fresh input tokens and 400 read from the cache (1,000 in OpenAI's count), 300 out.
COUNTS = {"input_tokens": 600, "cache_read_input_tokens": 400, "output_tokens": 300}
LONG_REPLY = "ab" * 200  # with pieces=200: 200 text deltas
PROMPT = 7  # the gateway's estimate of MESSAGES ("Say hello.": 3 tokens and 4 per message)
BAD_COUNTS: list[Any] = [-300, "300", 300.5, 300.0, None, True, 10**13]
Tokens = tuple[int, int, int]  # input, cached input, output, as charged


async def claude_gateway(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory, **fake: Any
) -> tuple[Any, RunningGateway]:
    up = await make_anthropic(usage=dict(COUNTS), **fake)
    backends = {"claude": {"kind": "anthropic", "base_url": up.url, "api_key_env": KEY_ENV}}
    models = {"c": {"backend": "claude", "model": "claude-test-1", "price": PRICE}}
    policy = limits_policy(up.url, None, {}, models=models, backends=backends)
    return up.fake, await make_gateway(policy, clock=Clock())


def claude_client(gw: RunningGateway) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=gw.root, api_key=KEYS["team-a"], max_retries=0, timeout=20
    )


async def charged(gw: RunningGateway) -> Tokens:
    """The tokens charged so far (the metrics count them as they are charged)."""
    await settled(gw)
    kinds = ("input", "cached_input", "output")
    counts = [await metric([gw], "llm_gateway_tokens_total", kind=kind) for kind in kinds]
    return int(counts[0]), int(counts[1]), int(counts[2])


async def charged_for(gw: RunningGateway, request: Any) -> Tokens:
    """What one request (an awaitable) was charged."""
    before = await charged(gw)
    await request
    after = await charged(gw)
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


async def test_a_messages_stream_its_client_left_is_charged_the_events_it_was_sent(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """The client reads the whole text and leaves at content_block_stop, before message_delta
    (held back 3 s) says 300: it is charged message_start's input and the ~200 events it
    was sent, not message_start's placeholder of 1 output token."""
    _, gw = await claude_gateway(
        make_anthropic, make_gateway, reply=LONG_REPLY, pieces=200, delta_pause_ms=3000
    )
    claude = claude_client(gw)
    texts = 0
    async with claude.messages.stream(model="c", max_tokens=1000, messages=MESSAGES) as stream:
        async for event in stream:
            texts += event.type == "text"
            if event.type == "content_block_stop":
                break
    await claude.close()
    assert texts == 200
    for _ in range(300):  # the gateway notices the close, then settles
        used = await charged(gw)
        if used[2]:
            break
        await asyncio.sleep(0.02)
    assert used[:2] == (1000, 400)  # as message_start counted the input
    assert 200 <= used[2] < 300  # the events it was sent (message_start's 1 before the fix)


async def test_unreadable_counts_of_a_messages_stream_are_charged_the_estimate(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """A message_delta's output count that is no count: message_start's input and the events
    sent; a message_start's input that is no count: the prompt's estimate (never a zero)."""
    fake, gw = await claude_gateway(make_anthropic, make_gateway, reply=LONG_REPLY, pieces=200)
    claude = claude_client(gw)

    async def stream() -> None:  # the raw events (the SDK's helper reads the usage too)
        events = await claude.messages.create(
            model="c", max_tokens=1000, messages=MESSAGES, stream=True
        )
        assert [event.type async for event in events][-1] == "message_stop"

    assert await charged_for(gw, stream()) == (1000, 400, 300)  # the counts, when they read
    for bad in BAD_COUNTS:
        fake.stream_usage = {"message_delta": {"output_tokens": bad}}
        used = await charged_for(gw, stream())
        assert used[:2] == (1000, 400), bad
        assert 200 <= used[2] < 300, bad  # the events sent, not message_start's 1
    starts = [{**COUNTS, "input_tokens": -500}, {**COUNTS, "cache_read_input_tokens": -5}, OMIT]
    for start in starts:
        fake.stream_usage = {"message_start": start}
        used = await charged_for(gw, stream())
        assert used[:2] == (PROMPT, 0), start  # not 0 input tokens
        assert 200 <= used[2] < 300, start
    await claude.close()


async def test_missing_or_malformed_counts_translated_are_charged_the_estimate(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """Chat and Responses clients of an Anthropic backend, whole and streamed: counts that are
    missing or malformed are charged the estimate, as an upstream's that reports no usage,
    never as a zero usage."""
    fake, gw = await claude_gateway(make_anthropic, make_gateway)
    c = client(gw)
    # Whole answers: the prompt's estimate and max_tokens, 7 x 1000 + 20 x 2000 per Mtok.
    estimate = "0.047"
    _, headers, _ = await chat(c, model="c", max_tokens=20)
    assert headers["x-gateway-cost-usd"] == "1.3"  # 600 x 1000 + 400 x 250 + 300 x 2000
    bad_usages = [
        OMIT,
        [1],
        {**COUNTS, "input_tokens": -500},
        *({**COUNTS, "output_tokens": bad} for bad in BAD_COUNTS),
        {"input_tokens": 600, "cache_read_input_tokens": 400},  # no output count
    ]
    for usage in bad_usages:
        fake.usage = usage
        status, headers, reply = await chat(c, model="c", max_tokens=20)
        assert status == 200 and reply.usage is None, usage  # as a vLLM's without usage
        assert headers["x-gateway-cost-usd"] == estimate, usage
        raw = await c.responses.with_raw_response.create(
            model="c", input="Say hello.", max_output_tokens=20
        )
        assert raw.headers["x-gateway-cost-usd"] == estimate, usage
        # Streamed: the prompt's estimate and the events sent (a few; never 0 tokens).
        chunks = await charged_for(gw, _chat_stream(c))
        assert chunks[0] == PROMPT and 0 < chunks[2] < 20, usage
        events = await charged_for(gw, _responses_stream(c))
        assert events[0] == PROMPT and 0 < events[2] < 20, usage


async def _chat_stream(c: openai.AsyncOpenAI) -> None:
    stream = await c.chat.completions.create(
        model="c",
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices and all(chunk.usage is None for chunk in chunks)


async def _responses_stream(c: openai.AsyncOpenAI) -> None:
    async with c.responses.stream(model="c", input="Say hello.", max_output_tokens=20) as events:
        await events.get_final_response()


async def test_a_messages_answer_without_its_output_count_is_charged_the_estimate(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    fake, gw = await claude_gateway(make_anthropic, make_gateway)
    fake.usage = {"input_tokens": 600, "cache_read_input_tokens": 400}
    raw = await claude_client(gw).messages.with_raw_response.create(
        model="c", max_tokens=20, messages=MESSAGES
    )
    assert raw.headers["x-gateway-cost-usd"] == "0.047"  # 7 x 1000 + 20 x 2000, not 0.7


@pytest.mark.parametrize(
    ("left_out", "cost"),
    [
        (("completion_tokens",), "0.017"),  # 6 = total 11 - prompt 5: 5 x 1000 + 6 x 2000
        (("completion_tokens", "total_tokens"), "0.047"),  # the estimate: 7 in, 20 out
    ],
)
async def test_a_usage_without_its_output_count_is_not_charged_zero_output(
    make_fake: FakeFactory, make_gateway: GatewayFactory, left_out: tuple[str, ...], cost: str
) -> None:
    fake = await make_fake(usage_without=left_out)
    gw = await make_gateway(limits_policy(fake.url, None, {}), clock=Clock())
    c = client(gw)
    _, headers, _ = await chat(c, max_tokens=20)
    assert headers["x-gateway-cost-usd"] == cost  # 0.005 (no output) before
    await c.close()
