"""What the cache stores is an answer to the request as the client asked it: never one the
gateway degraded for this request alone (shortened by ``cap_output``, or made by a spent
budget's downgrade model), which a later request under other conditions would be served."""

from __future__ import annotations

from typing import Any

import openai

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy
from tests.e2e.limits_helpers import client, downgrade_policy, settled
from tests.gateway.limits.conftest import Clock

QUESTION: Any = [{"role": "user", "content": "Write a haiku about rain."}]


async def ask(gw: RunningGateway, c: openai.AsyncOpenAI, **extra: Any) -> tuple[str, Any]:
    """The answer's text and the request's ``x-gateway-cache``, once the fill has run."""
    raw = await c.chat.completions.with_raw_response.create(
        model="m", messages=QUESTION, temperature=0, **extra
    )
    reply = raw.parse()
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    await settled(gw)
    return reply.choices[0].message.content or "", raw.headers


async def test_a_downgraded_answer_is_not_stored_under_the_alias(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    big, small = await make_fake(reply="big"), await make_fake(reply="small")
    surfaces = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(downgrade_policy(big.url, small.url, surfaces), clock=Clock())
    c = client(gw)
    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "spend"}])
    await settled(gw)  # the budget is spent: "m" is served by "lite" from now on
    text, headers = await ask(gw, c)
    assert (text, headers["x-gateway-downgraded"]) == ("small", "lite")
    # Stored, it would be replayed as "m"'s answer once the budget allows "m" again.
    text, headers = await ask(gw, c)
    assert headers["x-gateway-cache"] == "miss" and len(small.fake.requests) == 2
    await c.close()


async def test_an_answer_shortened_by_cap_output_is_not_stored(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=10, chunk_interval_ms=20)
    surfaces = """
  default:
    budget: {total_ms: 200}
    actions: {cap_output: true}
    cache: {exact: true}
"""
    gw = await make_gateway(pool_policy([up.url], f"surfaces:\n{surfaces}"))
    warm = await gw.client.chat.completions.create(
        model="m", messages=QUESTION, stream=True, max_tokens=10, temperature=1
    )
    async for _ in warm:
        pass  # the replica's inter-token latency (~20 ms) is known from here on
    _, headers = await ask(gw, gw.client, max_tokens=500)
    assert up.fake.requests[-1].body["max_tokens"] < 500  # shortened to fit 200 ms
    # A request asking the same, when the replica is fast again, would get the short answer.
    _, headers = await ask(gw, gw.client, max_tokens=500)
    assert headers["x-gateway-cache"] == "miss" and len(up.fake.requests) == 3
    # An answer the gateway did not shorten is stored as before.
    _, headers = await ask(gw, gw.client, max_tokens=1)
    _, headers = await ask(gw, gw.client, max_tokens=1)
    assert headers["x-gateway-cache"] == "exact"
