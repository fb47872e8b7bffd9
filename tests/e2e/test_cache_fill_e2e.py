"""What the cache stores is an answer to the request as the client asked it: never one the
gateway degraded for this request alone (shortened by ``cap_output``, made by a spent budget's
downgrade model, a fallback backend, or a cascade's small tier standing in for a failed large
one), which a later request under other conditions would be served. And a hit is the stored
answer as a new one: fresh ids, its tool calls' included."""

from __future__ import annotations

from typing import Any

import openai

from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningGateway,
    build_policy,
    pool_policy,
    vllm,
)
from tests.e2e.limits_helpers import client, downgrade_policy, settled
from tests.gateway.limits.conftest import Clock

QUESTION: Any = [{"role": "user", "content": "Write a haiku about rain."}]


EXACT = {"default": {"cache": {"exact": True}}}


async def ask(
    gw: RunningGateway, c: openai.AsyncOpenAI, model: str = "m", **extra: Any
) -> tuple[str, Any]:
    """The answer's text and the request's headers, once the fill has run."""
    raw = await c.chat.completions.with_raw_response.create(
        model=model, messages=QUESTION, temperature=0, **extra
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
    spend: Any = [{"role": "user", "content": "spend"}]
    await c.chat.completions.create(model="m", messages=spend, max_tokens=6)
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


async def test_a_fallback_backends_answer_is_not_stored_under_the_alias(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    # The alias's key names its primary backend and model: the fallback's answer, stored
    # there, was served for the cache's whole TTL after the primary was back.
    primary, fallback = await make_fake(reply="primary"), await make_fake(reply="fallback")
    models = {
        "m": {
            "backend": "up",
            "model": "fake-model",
            "fallbacks": [{"backend": "fb", "model": "fake-model"}],
        }
    }
    policy = build_policy({"up": vllm(primary.url), "fb": vllm(fallback.url)}, models)
    gw = await make_gateway(policy + f"surfaces: {EXACT}\n")
    primary.fake.queue("status:503")
    assert (await ask(gw, gw.client))[0] == "fallback"
    text, headers = await ask(gw, gw.client)
    assert (text, headers["x-gateway-cache"]) == ("primary", "miss")
    text, headers = await ask(gw, gw.client)  # the primary's answer is stored as before
    assert (text, headers["x-gateway-cache"]) == ("primary", "exact")


async def test_a_cascades_small_answer_standing_in_for_the_large_tier_is_not_stored(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    small, large = await make_fake(reply="maybe 12"), await make_fake(reply="large")
    backends = {"small": vllm(small.url), "large": {"kind": "openai", "base_url": large.url}}
    tiers = ["small", {"backend": "large", "model": "big-model"}]
    auto = {"tiers": tiers, "mode": "cascade", "threshold": -1.0}  # every answer escalates
    gw = await make_gateway(build_policy(backends, {"auto": auto}, surfaces=EXACT))
    large.fake.queue("status:503")
    text, headers = await ask(gw, gw.client, model="auto")
    assert (text, headers["x-gateway-tier-fallback"]) == ("maybe 12", "small")
    # The verifier refused that answer; the large tier failed for that request alone.
    text, headers = await ask(gw, gw.client, model="auto")
    assert (text, headers["x-gateway-cache"]) == ("large", "miss")


async def test_a_hit_under_a_spent_budget_is_not_said_downgraded(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    big, small = await make_fake(reply="big"), await make_fake(reply="small")
    gw = await make_gateway(downgrade_policy(big.url, small.url, EXACT), clock=Clock())
    c = client(gw)
    # Held: 11 prompt tokens (estimated) and 4 at "m"'s price, 0.019 of the 0.02 USD; stored,
    # its cost (0.017) leaves too little to cover another.
    text, headers = await ask(gw, c, max_tokens=4)
    text, headers = await ask(gw, c, max_tokens=4)
    assert (text, headers["x-gateway-cache"]) == ("big", "exact")
    assert "x-gateway-downgraded" not in headers  # the stored answer of "m" was served
    await c.close()


async def test_a_hit_has_fresh_tool_call_ids(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    # Agents match tool results to calls by id: every hit repeated the stored call's id.
    up = await make_fake(tool_calls=2)
    gw = await make_gateway(pool_policy([up.url], surfaces=EXACT))
    ids = []
    for _ in range(3):
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=QUESTION, temperature=0
        )
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        calls = raw.parse().choices[0].message.tool_calls or []
        assert len(calls) == 2
        ids += [call.id for call in calls]
    assert raw.headers["x-gateway-cache"] == "exact"
    assert len(set(ids)) == 6 and len(up.fake.requests) == 1


async def test_an_answer_cut_at_the_replicas_own_limit_is_not_stored(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """``finish_reason: length`` with no ``max_tokens`` from the client: the replica's default
    cut the answer, so it is no answer to the question (the probe's repro: the second request
    replayed the truncated text), streamed or not. Cut at the client's own limit, it is the
    answer to exactly that request (the key holds the limit) and is stored."""
    up = await make_fake(reply="a truncated", finish_reason="length")
    gw = await make_gateway(
        pool_policy([up.url], "surfaces:\n  default:\n    cache: {exact: true}")
    )
    for _ in range(2):
        _, headers = await ask(gw, gw.client)
        assert headers["x-gateway-cache"] == "miss"
        chunks = await gw.client.chat.completions.create(
            model="m", messages=QUESTION, temperature=0, stream=True
        )
        finish = [c.choices[0].finish_reason async for c in chunks if c.choices]
        assert finish[-1] == "length"
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
    assert len(up.fake.requests) == 4  # each asked the replica
    _, headers = await ask(gw, gw.client, max_tokens=5)
    _, headers = await ask(gw, gw.client, max_tokens=5)
    assert headers["x-gateway-cache"] == "exact" and len(up.fake.requests) == 5
