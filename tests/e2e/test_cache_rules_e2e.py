"""The cache's rules through the real gateway, for every API a question can come through.

The gateway's user's text exists only for a plain chat message; the rules ``personal`` and
``time`` must fire all the same for a question asked through the Messages or Responses API, or
beside an image, or one user's "where is my order?" is served to the whole tenant.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import pytest

from tests.conftest import FakeFactory, GatewayFactory, RunningFake, RunningGateway, pool_policy

PERSONAL = "Where is my order?"
TIMELY = "What is the weather today?"
IMAGE: Any = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
# Default rules (personal: off), and time: off so that its rule shows in the header too.
CACHE: Any = {"exact": True, "semantic": {"audit_fraction": 0}, "rules": {"time": "off"}}

Ask = Callable[[RunningGateway, str], Awaitable[tuple[str | None, str | None]]]


@pytest.fixture
async def claude() -> AsyncIterator[Callable[[RunningGateway], anthropic.AsyncAnthropic]]:
    clients: list[anthropic.AsyncAnthropic] = []

    def make(gw: RunningGateway) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(
            base_url=gw.root, api_key="unused", max_retries=0, timeout=20
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def gateway(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> tuple[RunningFake, RunningGateway]:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url], surfaces={"default": {"cache": CACHE}}))
    return up, gw


async def twice(
    gw: RunningGateway, up: RunningFake, ask: Callable[[], Awaitable[Any]]
) -> list[tuple[str | None, str | None]]:
    """Ask the same question twice; the cache headers of both answers, checking that the
    upstream answered both (nothing was served from the cache)."""
    before = len(up.fake.requests)
    seen = []
    for _ in range(2):
        headers = await ask()
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        seen.append((headers.get("x-gateway-cache"), headers.get("x-gateway-cache-skip")))
    assert len(up.fake.requests) == before + 2
    return seen


@pytest.mark.parametrize(("question", "rule"), [(PERSONAL, "personal"), (TIMELY, "time")])
async def test_the_rules_fire_for_the_messages_api(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    claude: Callable[[RunningGateway], anthropic.AsyncAnthropic],
    question: str,
    rule: str,
) -> None:
    up, gw = await gateway(make_fake, make_gateway)
    client = claude(gw)

    async def ask() -> Any:
        raw = await client.messages.with_raw_response.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
            extra_body={"temperature": 0},
        )
        message = await raw.parse()
        assert message.content[0].text == "hello from the fake upstream"  # type: ignore[union-attr]
        return raw.headers

    assert await twice(gw, up, ask) == [("skip", f"rule:{rule}")] * 2


@pytest.mark.parametrize(("question", "rule"), [(PERSONAL, "personal"), (TIMELY, "time")])
async def test_the_rules_fire_for_the_responses_api(
    make_fake: FakeFactory, make_gateway: GatewayFactory, question: str, rule: str
) -> None:
    up, gw = await gateway(make_fake, make_gateway)

    async def ask() -> Any:
        raw = await gw.client.responses.with_raw_response.create(
            model="m", input=question, temperature=0
        )
        assert raw.parse().output_text == "hello from the fake upstream"
        return raw.headers

    assert await twice(gw, up, ask) == [("skip", f"rule:{rule}")] * 2


@pytest.mark.parametrize(("question", "rule"), [(PERSONAL, "personal"), (TIMELY, "time")])
async def test_the_rules_fire_for_a_question_beside_an_image(
    make_fake: FakeFactory, make_gateway: GatewayFactory, question: str, rule: str
) -> None:
    up, gw = await gateway(make_fake, make_gateway)
    content: Any = [{"type": "text", "text": question}, IMAGE]

    async def ask() -> Any:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": content}], temperature=0
        )
        assert raw.parse().choices[0].message.content == "hello from the fake upstream"
        return raw.headers

    assert await twice(gw, up, ask) == [("skip", f"rule:{rule}")] * 2


async def test_an_impersonal_question_through_the_dialects_is_still_cached(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    claude: Callable[[RunningGateway], anthropic.AsyncAnthropic],
) -> None:
    up, gw = await gateway(make_fake, make_gateway)
    question = "What is the boiling point of water at sea level?"
    seen = []
    for _ in range(2):
        raw = await claude(gw).messages.with_raw_response.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},
        )
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        seen.append(raw.headers.get("x-gateway-cache"))
    assert seen == ["miss", "exact"]
    assert len(up.fake.requests) == 1
