"""The cache under the translated APIs (Anthropic's Messages beside chat): real Redis, the
official clients. A hit must be the answer the request would get live: never one to another
prompt (a prefill continued is not a new turn), nor one that lost what the live answer said
(vLLM's ``stop_reason``: which stop string ended it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy

SURFACE = {"X-Surface": "chat"}
PREFILLED: Any = [
    {"role": "user", "content": "Tell me about the standard library."},
    {"role": "assistant", "content": "The standard library"},
]


def policy(url: str, redis_url: str) -> str:
    surface = {"match": {"header": "chat"}, "cache": {"exact": True}}
    return pool_policy([url], surfaces={"chat": surface}, cache_store={"redis_url": redis_url})


@pytest.fixture
async def claude() -> AsyncIterator[list[anthropic.AsyncAnthropic]]:
    clients: list[anthropic.AsyncAnthropic] = []
    yield clients
    for client in clients:
        await client.close()


def anthropic_client(gw: RunningGateway, clients: list[anthropic.AsyncAnthropic]) -> Any:
    client = anthropic.AsyncAnthropic(
        base_url=gw.root, api_key="unused", max_retries=0, timeout=20, default_headers=SURFACE
    )
    clients.append(client)
    return client


async def drained(gw: RunningGateway) -> None:
    await gw.runtime.cache.drain()  # type: ignore[union-attr]


async def test_a_prefill_and_a_new_turn_on_the_same_messages_are_two_entries(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    claude: list[anthropic.AsyncAnthropic],
) -> None:
    """A Messages prefill is continued (vLLM gets ``continue_final_message``); a chat request
    with the same messages asks for a new assistant turn: another prompt, another answer. They
    shared one entry, so each was served the other's answer."""
    up = await make_fake()
    gw = await make_gateway(policy(up.url, redis_server.url))
    client = anthropic_client(gw, claude)

    async def prefill() -> tuple[str, str | None]:
        raw = await client.messages.with_raw_response.create(
            model="m", max_tokens=8, messages=PREFILLED, extra_body={"temperature": 0}
        )
        await drained(gw)
        return (await raw.parse()).content[0].text, raw.headers.get("x-gateway-cache")

    async def new_turn() -> tuple[str | None, str | None]:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", max_tokens=8, messages=PREFILLED, temperature=0, extra_headers=SURFACE
        )
        await drained(gw)
        return raw.parse().choices[0].message.content, raw.headers.get("x-gateway-cache")

    up.fake.queue("reply: is large.", "reply:Anything else?")
    assert await prefill() == (" is large.", "miss")
    assert await new_turn() == ("Anything else?", "miss")
    assert [r.body.get("continue_final_message") for r in up.fake.requests] == [True, None]
    assert await prefill() == (" is large.", "exact")
    assert await new_turn() == ("Anything else?", "exact")
    assert len(up.fake.requests) == 2


def question(n: int) -> Any:
    return [{"role": "user", "content": f"Tell me about the standard library, part {n}."}]


async def test_a_hit_says_which_stop_sequence_ended_the_answer_in_messages(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    claude: list[anthropic.AsyncAnthropic],
) -> None:
    """vLLM says which stop string ended an answer (``stop_reason``): live, a Messages answer
    is ``stop_reason: stop_sequence`` with that string. A hit said ``end_turn`` and no
    sequence: a streamed fill kept only ``finish_reason``, a streamed hit did not send it."""
    up = await make_fake(stop_reason="e")
    gw = await make_gateway(policy(up.url, redis_server.url))
    client = anthropic_client(gw, claude)
    ask: Any = {"model": "m", "max_tokens": 41, "stop_sequences": ["e"]}
    ask["extra_body"] = {"temperature": 0}

    async def whole(messages: Any) -> tuple[Any, str | None]:
        raw = await client.messages.with_raw_response.create(**ask, messages=messages)
        await drained(gw)
        message = await raw.parse()
        return (message.stop_reason, message.stop_sequence), raw.headers.get("x-gateway-cache")

    async def streamed(messages: Any) -> tuple[Any, str | None]:
        async with client.messages.stream(**ask, messages=messages) as stream:
            message = await stream.get_final_message()
            cache = stream.response.headers.get("x-gateway-cache")
        await drained(gw)
        return (message.stop_reason, message.stop_sequence), cache

    live = ("stop_sequence", "e")
    assert await streamed(question(1)) == (live, "miss")
    assert await whole(question(1)) == (live, "exact")
    assert await whole(question(2)) == (live, "miss")
    assert await streamed(question(2)) == (live, "exact")
    assert len(up.fake.requests) == 2


async def test_a_chat_hit_keeps_vllms_stop_reason(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    up = await make_fake(stop_reason="e")
    gw = await make_gateway(policy(up.url, redis_server.url))
    ask: Any = {"model": "m", "temperature": 0, "stop": ["e"], "extra_headers": SURFACE}

    async def whole(messages: Any) -> tuple[Any, str | None]:
        raw = await gw.client.chat.completions.with_raw_response.create(**ask, messages=messages)
        await drained(gw)
        choice = raw.parse().choices[0]
        extra = choice.model_extra or {}
        return (choice.finish_reason, extra.get("stop_reason")), raw.headers.get("x-gateway-cache")

    async def streamed(messages: Any) -> tuple[Any, str | None]:
        raw = await gw.client.chat.completions.with_raw_response.create(
            **ask, messages=messages, stream=True
        )
        ends = [c.choices[0] async for c in raw.parse() if c.choices and c.choices[0].finish_reason]
        await drained(gw)
        extra = ends[-1].model_extra or {}
        return (ends[-1].finish_reason, extra.get("stop_reason")), raw.headers.get(
            "x-gateway-cache"
        )

    live = ("stop", "e")
    assert await streamed(question(1)) == (live, "miss")
    assert await whole(question(1)) == (live, "exact")
    assert await whole(question(2)) == (live, "miss")
    assert await streamed(question(2)) == (live, "exact")
    assert len(up.fake.requests) == 2
