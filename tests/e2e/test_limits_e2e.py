"""Tenant limits and budgets through real gateways sharing one real Redis, called with the
official openai client: exact across instances, refusals as OpenAI sends them, window reset,
Redis killed mid-run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
import redis.asyncio as aioredis

from gateway.limits.redis_store import RedisLimitStore
from tests.cache.conftest import RedisServer
from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningGateway,
    build_policy,
    closed_port_url,
    vllm,
)
from tests.e2e.conftest import KEY_ENV, AnthropicFactory
from tests.e2e.limits_helpers import (
    CHEAP,
    KEYS,
    MESSAGES,
    PRICE,
    chat,
    client,
    downgrade_policy,
    limits_policy,
    metric,
    settled,
    spread,
    tenants,
    usage_report,
)
from tests.gateway.limits.conftest import Clock

pytestmark = pytest.mark.redis

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


async def three(make_gateway: GatewayFactory, policy: str, clock: Clock) -> list[RunningGateway]:
    return [await make_gateway(policy, clock=clock) for _ in range(3)]


async def test_three_instances_admit_exactly_the_limit(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    fake = await make_fake()
    policy = limits_policy(fake.url, redis_server.url, {"limits": {"requests_per_minute": 20}})
    gateways = await three(make_gateway, policy, Clock())  # one instant: no refill in the burst
    statuses = await spread([clients(gw) for gw in gateways], 60)
    assert statuses.count(200) == 20 and statuses.count(429) == 40
    assert len(fake.fake.requests) == 20
    status, headers, body = await chat(clients(gateways[1]))
    assert status == 429
    assert body["type"] == body["code"] == "rate_limit_exceeded"  # openai puts error in .body
    assert (headers["retry-after"], headers["x-ratelimit-remaining-requests"]) == ("3", "0")
    assert headers["x-ratelimit-limit-requests"] == "20"
    # Another tenant is not touched by team-a's limit.
    other = [clients(gw, "team-b") for gw in gateways]
    assert (await spread(other, 6)) == [200] * 6
    refused = await metric(gateways, "llm_gateway_rate_limited_total", tenant="team-a")
    assert refused == 41


async def test_grants_serve_most_requests_and_the_limit_stays_exact(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    """A limit far enough away for grants of 16: three instances asked steadily until twice
    the limit admit exactly the limit (one instant: no refill), most of it from grants."""
    fake = await make_fake()
    limit = 1_280  # room for grants of 16 (64 x 16 = 1,024 left when one is taken)
    policy = limits_policy(fake.url, redis_server.url, {"limits": {"requests_per_minute": limit}})
    gateways = await three(make_gateway, policy, Clock())
    statuses: list[int] = []

    async def steady(c: openai.AsyncOpenAI) -> None:
        while len(statuses) < 2 * limit:
            slot = len(statuses)
            statuses.append(-1)  # counted before the await: the loops stop at 2 x limit
            statuses[slot] = (await chat(c))[0]

    await asyncio.gather(*(steady(clients(gw)) for gw in gateways for _ in range(4)))
    assert statuses.count(200) == limit and statuses.count(429) == limit
    assert len(fake.fake.requests) == limit
    granted = await metric(gateways, "llm_gateway_limits_granted_total")
    assert limit // 2 < granted < limit
    await settled(*gateways)  # what the grants held unused is given back


async def test_every_response_of_a_limited_tenant_carries_its_limits(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake()
    rules = {"limits": {"requests_per_minute": 10, "tokens_per_minute": 5_000}}
    gw = await make_gateway(limits_policy(fake.url, None, rules), clock=Clock())
    status, headers, _ = await chat(clients(gw), max_tokens=20)
    assert status == 200
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-reset-requests"] == "6s"
    assert headers["x-ratelimit-limit-tokens"] == "5000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 5_000
    fake.fake.queue("status:400")  # the upstream's own error: relayed, with the limits
    status, headers, _ = await chat(clients(gw))
    assert status == 400 and headers["x-ratelimit-remaining-requests"] == "8"
    status, headers, _ = await chat(clients(gw), model="nope")
    assert status == 404  # refused before any limit was taken
    status, headers, _ = await chat(clients(gw, "team-b"))
    assert status == 200 and "x-ratelimit-limit-requests" not in headers


async def test_tokens_per_minute_holds_within_one_reconciliation(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    # Each answer uses 305 tokens (5 in, 300 out) where its reservation was ~16 (max_tokens 10):
    # the limit can be passed by one request's reconciliation, never by more.
    fake = await make_fake(completion_tokens=300)
    rules = {"limits": {"tokens_per_minute": 1_000}}
    gateways = await three(make_gateway, limits_policy(fake.url, redis_server.url, rules), Clock())
    admitted = 0
    for i in range(10):
        status, _, _ = await chat(clients(gateways[i % 3]), max_tokens=10)
        await settled(*gateways)
        if status != 200:
            assert status == 429
            break
        admitted += 1
    used = admitted * 305
    assert used > 1_000 and used - 1_000 < 305
    status, headers, body = await chat(clients(gateways[0]), max_tokens=10)
    assert status == 429 and body["code"] == "rate_limit_exceeded"
    assert headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_batched_completions_request_reserves_for_every_prompt(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    # 20 prompts x 100 tokens may use 2,000 tokens: past a 1,000 a minute limit before it runs
    # (reserving for one prompt let a single request take the minute twice over).
    fake = await make_fake()
    rules = {"limits": {"tokens_per_minute": 1_000}}
    gw = await make_gateway(limits_policy(fake.url, None, rules), clock=Clock())
    batch = [f"prompt {i}" for i in range(20)]
    with pytest.raises(openai.RateLimitError) as refused:
        await clients(gw).completions.create(model="m", prompt=batch, max_tokens=100)
    assert len(fake.fake.requests) == 0
    assert "token" in refused.value.message
    one = await clients(gw).completions.create(model="m", prompt=batch[:5], max_tokens=100)
    assert one.choices and len(fake.fake.requests) == 1  # 500 tokens fit


async def test_reservations_are_reconciled_to_real_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake()  # 11 tokens per answer
    rules = {"limits": {"tokens_per_minute": 1_000}}
    gw = await make_gateway(limits_policy(fake.url, None, rules), clock=Clock())
    admitted = 0
    while admitted < 200:
        status, _, _ = await chat(clients(gw), max_tokens=100)
        await settled(gw)
        if status != 200:
            break
        admitted += 1
    # Each reserves ~105 (prompt estimate + max_tokens) and settles at 11: it is the real
    # usage that fills the minute, up to one reservation short of the limit.
    assert 1_000 - 105 < admitted * 11 <= 1_000


async def test_a_failed_request_gives_its_tokens_back(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake()
    gw = await make_gateway(
        limits_policy(fake.url, None, {"limits": {"tokens_per_minute": 10_000}}), clock=Clock()
    )
    status, headers, _ = await chat(clients(gw), max_tokens=500)
    reserved = 10_000 - int(headers["x-ratelimit-remaining-tokens"])
    await settled(gw)  # settled at its 11 real tokens
    fake.fake.queue("status:503")  # the upstream fails (its only replica): a 502
    status, headers, _ = await chat(clients(gw), max_tokens=500)
    assert status == 502 and "x-ratelimit-remaining-tokens" in headers
    await settled(gw)
    status, headers, _ = await chat(clients(gw), max_tokens=500)
    assert status == 200
    # Only the first answer's real usage and this request's reservation are held.
    assert int(headers["x-ratelimit-remaining-tokens"]) == 10_000 - 11 - reserved


async def test_spent_budget_refuses_with_insufficient_quota_across_instances(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    fake = await make_fake()
    budget = {"usd": 0.05, "window": "day", "alert_at": [0.3, 0.6]}
    policy = limits_policy(fake.url, redis_server.url, {"budget": budget})
    gateways = await three(make_gateway, policy, Clock())
    costs = []
    for i in range(2):  # 0.017 each (each held HELD = 0.019 until it settled)
        status, headers, _ = await chat(clients(gateways[i]), max_tokens=6)
        assert status == 200
        costs.append(headers["x-gateway-cost-usd"])
        await settled(*gateways)
    assert costs == ["0.017"] * 2
    for gw in gateways:  # 0.016 left: a third answer may cost 0.019
        status, headers, body = await chat(clients(gw), max_tokens=6)
        assert status == 429
        assert body["type"] == body["code"] == "insufficient_quota"
        assert "0.016 USD left of its daily budget of 0.05 USD" in body["message"]
        assert "may cost up to 0.019 USD" in body["message"]
        assert int(headers["retry-after"]) > 0  # when the day ends
    assert len(fake.fake.requests) == 2
    # Each alert fired once, whichever instance crossed it.
    assert await metric(gateways, "llm_gateway_budget_alerts_total", fraction="0.3") == 1
    assert await metric(gateways, "llm_gateway_budget_alerts_total", fraction="0.6") == 1
    cost = await metric(gateways, "llm_gateway_cost_usd_total", tenant="team-a", model="m")
    assert cost == pytest.approx(0.034)


async def test_a_burst_over_two_instances_never_passes_the_budget(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    """Ten requests at once over two instances, each answer 0.017 USD and each held at its
    worst case (HELD, 0.019) until it settles: only what the 0.05 budget covers is admitted,
    so the spend stays within it (checked against settled spend alone, all ten passed)."""
    fake = await make_fake(latency_ms=300)  # every answer still running when the last asks
    policy = limits_policy(fake.url, redis_server.url, {"budget": {"usd": 0.05, "window": "day"}})
    clock = Clock()
    gateways = [await make_gateway(policy, clock=clock) for _ in range(2)]
    statuses = await spread([clients(gw) for gw in gateways], 10, max_tokens=6)
    assert statuses.count(200) == 2 and statuses.count(429) == 8
    await settled(*gateways)
    _, report = await usage_report(gateways[1], tenant="team-a", window="day")
    assert (report["spend_usd"], report["held_usd"], report["budget_usd"]) == ("0.034", "0", "0.05")
    assert len(fake.fake.requests) == 2


async def test_the_largest_budget_holds_a_huge_request_exactly_and_others_keep_their_limits(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    """A budget of 10**12 USD (the most a policy takes) and a request holding 10**11 USD
    (10**17 micro-dollars, which Redis wrote as ``1e+17``): its settlement failed in its script,
    which put the whole store in back-off, so another tenant's limit was not enforced."""
    fake = await make_fake()
    budget = {"budget": {"usd": 10**12, "window": "day"}}
    policy = limits_policy(
        fake.url, redis_server.url, budget, team_b={"limits": {"requests_per_minute": 2}}
    )
    gw = await make_gateway(policy, clock=Clock())
    for _ in range(2):
        status, headers, _ = await chat(clients(gw), max_tokens=50_000_000_000_000)
        assert status == 200 and headers["x-gateway-cost-usd"] == "0.017"
        await settled(gw)
    _, report = await usage_report(gw, tenant="team-a", window="day")
    assert (report["spend_usd"], report["held_usd"]) == ("0.034", "0")
    assert [(await chat(clients(gw, "team-b")))[0] for _ in range(3)] == [200, 200, 429]
    store = gw.runtime.limiter.store
    assert isinstance(store, RedisLimitStore) and (store.failures, store.script_errors) == (0, 0)


async def test_a_sequential_client_is_never_refused_for_its_finished_request_after_a_flush(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    """Redis's script cache flushed (``SCRIPT FLUSH``, a restart): a settlement that waited
    for its script to be reloaded was overtaken by the client's next check, which found the
    finished request's slot still taken (two rounds in five were 200, 429, 200)."""
    fake = await make_fake()
    limits = {"limits": {"requests_per_minute": 100_000, "max_concurrent": 1}}
    gw = await make_gateway(limits_policy(fake.url, redis_server.url, limits), clock=Clock())
    user = clients(gw)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        rounds = []
        for _ in range(30):
            await admin.script_flush()
            rounds.append([(await chat(user))[0] for _ in range(3)])
    finally:
        await admin.aclose()
    assert rounds == [[200] * 3] * 30


async def test_a_client_that_leaves_mid_stream_releases_its_hold(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake(chunks=100, chunk_interval_ms=20)
    budget = {"budget": {"usd": 1, "window": "day"}}
    gw = await make_gateway(limits_policy(fake.url, None, budget), clock=Clock())
    body = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 200}
    auth = {"Authorization": f"Bearer {KEYS['team-a']}"}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.base_url + "/chat/completions", json=body, headers=auth)
        await resp.content.readline()
        _, report = await usage_report(gw, tenant="team-a", window="day")
        assert report["held_usd"] == "0.407"  # 7 x 1000 + 200 x 2000 per Mtok
        resp.close()  # the client goes away mid-stream
    for _ in range(200):
        await settled(gw)
        _, report = await usage_report(gw, tenant="team-a", window="day")
        if report["requests"]:
            break
        await asyncio.sleep(0.01)
    assert report["held_usd"] == "0" and report["spend_usd"] != "0"  # charged what it was sent


async def test_downgrade_serves_the_named_cheaper_model(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    big, small = await make_fake(reply="big"), await make_fake(reply="small")
    gw = await make_gateway(downgrade_policy(big.url, small.url), clock=Clock())
    status, headers, reply = await chat(clients(gw), max_tokens=6)
    assert status == 200 and "x-gateway-downgraded" not in headers
    await settled(gw)
    status, headers, reply = await chat(clients(gw), max_tokens=6)
    assert status == 200
    assert headers["x-gateway-downgraded"] == "lite"
    assert reply.choices[0].message.content == "small"
    assert headers["x-gateway-cost-usd"] == "0.00017"  # priced as lite: 5 x 10 + 6 x 20 per Mtok


async def test_downgrade_without_a_cheaper_model_is_refused(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    fake = await make_fake()
    budget = {"usd": 0.02, "on_exhausted": "downgrade"}
    gw = await make_gateway(limits_policy(fake.url, None, {"budget": budget}), clock=Clock())
    assert (await chat(clients(gw), max_tokens=6))[0] == 200
    await settled(gw)
    status, _, body = await chat(clients(gw), max_tokens=6)
    assert status == 429 and body["code"] == "insufficient_quota"
    assert "no cheaper tier" in body["message"]


async def test_a_passthroughs_downgrade_goes_only_where_its_api_is_served(
    make_fake: FakeFactory,
    make_anthropic: AnthropicFactory,
    make_gateway: GatewayFactory,
    clients: Clients,
) -> None:
    """The downgrade of a request relayed untranslated (Messages to a kind: anthropic backend,
    a Responses passthrough) whose budget cannot cover it goes only to a backend that serves
    that API itself, else it is refused, in the caller's format; a chat request is downgraded
    anywhere. The downgrade went wherever its model was (Anthropic's body POSTed to a vLLM
    server's /v1/messages with its key; a valid Responses request answered 400)."""
    claude, relaying, plain = await make_anthropic(), await make_fake(), await make_fake()
    backends = {
        "claude": {"kind": "anthropic", "base_url": claude.url, "api_key_env": KEY_ENV},
        "relaying": vllm(relaying.url, responses="passthrough"),
        "plain": vllm(plain.url),
    }
    dear = {"input_per_mtok": 100_000, "output_per_mtok": 100_000}  # 0.1 USD a token
    models = {
        "c": {"backend": "claude", "model": "claude-test-1", "price": dear},
        "r": {"backend": "relaying", "model": "fake-model", "price": dear},
        "lite": {"backend": "plain", "model": "fake-model", "price": CHEAP},
        "haiku": {"backend": "claude", "model": "claude-small", "price": CHEAP},
    }
    budget = {"usd": 0.01, "on_exhausted": "downgrade"}
    rules = {"team-a": {"budget": {**budget, "downgrade_to": "lite"}},
             "team-b": {"budget": {**budget, "downgrade_to": "haiku"}}}  # fmt: skip
    gw = await make_gateway(build_policy(backends, models, tenants=tenants(**rules)), clock=Clock())
    # Any request of "c" or "r" may cost more than the whole 0.01 USD: each is downgraded.
    openai_a = clients(gw)
    async with (
        anthropic.AsyncAnthropic(base_url=gw.root, api_key=KEYS["team-a"], max_retries=0) as a,
        anthropic.AsyncAnthropic(base_url=gw.root, api_key=KEYS["team-b"], max_retries=0) as b,
    ):
        with pytest.raises(anthropic.RateLimitError) as refused:
            await a.messages.create(model="c", max_tokens=8, messages=MESSAGES)
        assert "has no backend that serves the Messages API itself" in refused.value.message
        served = await b.messages.with_raw_response.create(
            model="c", max_tokens=8, messages=MESSAGES
        )
    assert served.headers["x-gateway-downgraded"] == "haiku"
    assert (await served.parse()).content[0].text == "Hello from the fake Claude."  # type: ignore[union-attr]
    assert claude.fake.requests[-1].body["model"] == "claude-small"
    with pytest.raises(openai.RateLimitError) as spent:
        await openai_a.responses.create(model="r", input="hi")
    assert spent.value.code == "insufficient_quota"
    status, headers, _ = await chat(openai_a, model="c")  # translated: any backend serves it
    assert status == 200 and headers["x-gateway-downgraded"] == "lite"
    assert [r.path for r in plain.fake.requests] == ["/v1/chat/completions"]
    assert [r.path for r in relaying.fake.requests] == []


async def test_windows_reset(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
) -> None:
    fake = await make_fake()
    clock = Clock(1_795_010_000.0)  # 2026-11-18, 13:53 UTC
    rules = {"limits": {"requests_per_minute": 2}, "budget": {"usd": 0.06, "window": "day"}}
    gw = await make_gateway(limits_policy(fake.url, redis_server.url, rules), clock=clock)
    c = clients(gw)
    for remaining in ("1", "0"):
        status, headers, _ = await chat(c, max_tokens=6)
        assert status == 200 and headers["x-ratelimit-remaining-requests"] == remaining
    await settled(gw)
    status, headers, body = await chat(c, max_tokens=6)
    assert status == 429 and body["code"] == "rate_limit_exceeded"  # 2 per minute
    assert headers["retry-after"] == "30"
    clock.advance(30)  # one request comes back every 30 s
    assert (await chat(c, max_tokens=6))[0] == 200  # 3 x 0.017 = 0.051 spent
    await settled(gw)
    status, _, body = await chat(c, max_tokens=6)  # the 0.009 left cannot cover 0.019
    assert status == 429 and body["code"] == "insufficient_quota"
    clock.t = 1_795_046_400.0  # the next day, 00:00 UTC: a new budget window
    status, headers, _ = await chat(c, max_tokens=6)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1"
    await settled(gw)


@pytest.mark.parametrize("mode", ["open", "closed"])
@pytest.mark.parametrize("granted", [False, True], ids=["checked", "granted"])
async def test_redis_killed_mid_run_keeps_the_configured_direction(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    clients: Clients,
    mode: str,
    granted: bool,
) -> None:
    """Also when the instances hold grants: the first sign of Redis going (its connections
    closing) ends them, so every request after it meets the configured direction."""
    fake = await make_fake()
    limits = {"requests_per_minute": 10_000} if granted else {"requests_per_minute": 1_000}
    if not granted:
        limits["max_concurrent"] = 50  # too few for a grant (64 x 2 needed)
    policy = limits_policy(fake.url, redis_server.url, {"limits": limits}, failure_mode=mode)
    gateways = await three(make_gateway, policy, Clock())
    users = [clients(gw) for gw in gateways]
    for _ in range(3):  # one at a time per instance: the second check takes a grant
        assert await spread(users, 3) == [200] * 3
    in_grants = sum(len(gw.runtime.limiter._grants) for gw in gateways)
    assert in_grants == (3 if granted else 0)
    redis_server.stop()
    statuses = await spread(users, 30)
    if mode == "open":
        assert statuses == [200] * 30
    else:
        assert statuses == [503] * 30
        status, headers, body = await chat(users[0])
        assert body["code"] == "limits_unavailable" and "retry-after" in headers
    assert 500 not in statuses
    assert await metric(gateways, "llm_gateway_limits_unavailable_total", direction=mode) >= 30
    redis_server.start()  # empty, on the same port
    await asyncio.sleep(1.2)  # past the store's back-off
    assert await spread(users, 6) == [200] * 6
    status, headers, _ = await chat(users[0])
    limit = limits["requests_per_minute"]
    assert status == 200 and int(headers["x-ratelimit-remaining-requests"]) < limit


async def test_downgrade_serves_the_alias_small_tier(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients
) -> None:
    small, large = await make_fake(reply="small"), await make_fake(reply="large")
    backends = {"small": {"kind": "openai", "base_url": small.url},
                "large": {"kind": "openai", "base_url": large.url}}  # fmt: skip
    tiers = [{"backend": "small", "price": CHEAP}, {"backend": "large", "price": PRICE}]
    models = {"m": {"tiers": tiers, "mode": "route", "threshold": -1.0}}  # always large
    budget = {"usd": 0.02, "on_exhausted": "downgrade"}
    gw = await make_gateway(
        limits_policy(small.url, None, {"budget": budget}, models=models, backends=backends),
        clock=Clock(),
    )
    status, headers, reply = await chat(clients(gw), max_tokens=6)
    assert status == 200 and headers["x-gateway-tier"] == "large"
    assert headers["x-gateway-cost-usd"] == "0.017"
    await settled(gw)
    # Held at the large tier's price (0.019), not the small one's (0.00019): the 0.003 left
    # cannot cover it, so the alias is served by its small tier.
    status, headers, reply = await chat(clients(gw), max_tokens=6)
    assert status == 200 and reply.choices[0].message.content == "small"
    assert headers["x-gateway-downgraded"] == "small" and "x-gateway-tier" not in headers
    assert headers["x-gateway-cost-usd"] == "0.00017"
    assert await metric([gw], "llm_gateway_budget_downgrades_total", tenant="team-a") == 1


async def test_limit_counts_survive_reloads_with_the_direction_each_decision_took(
    make_fake: FakeFactory, make_gateway: GatewayFactory, clients: Clients, tmp_path: Path
) -> None:
    """A reload that changes ``limits_failure_mode`` keeps the decisions taken the other way
    under their own direction; one that changes the store (a new limiter) keeps every count."""
    fake = await make_fake()
    path = tmp_path / "policy.yaml"
    limits = {"limits": {"requests_per_minute": 1_000}}

    async def serve_with(redis_url: str, mode: str, requests: int) -> None:
        path.write_text(limits_policy(fake.url, redis_url, limits, failure_mode=mode))
        async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
            assert r.status == 200, await r.text()
        for _ in range(requests):
            status, _, _ = await chat(user)
            assert status == (200 if mode == "open" else 503)

    down = "redis" + closed_port_url().removeprefix("http").removesuffix("/v1")  # nothing there
    path.write_text(limits_policy(fake.url, down, limits))
    gw = await make_gateway(path.read_text(), policy_path=path)
    user = clients(gw)
    await serve_with(down, "open", 2)
    await serve_with(down, "closed", 1)  # the same store: the same limiter, told otherwise
    assert await metric([gw], "llm_gateway_limits_unavailable_total", direction="open") == 2
    assert await metric([gw], "llm_gateway_limits_unavailable_total", direction="closed") == 1
    other = "redis" + closed_port_url().removeprefix("http").removesuffix("/v1")
    await serve_with(other, "closed", 1)  # another store: a new limiter
    assert await metric([gw], "llm_gateway_limits_unavailable_total", direction="open") == 2
    assert await metric([gw], "llm_gateway_limits_unavailable_total", direction="closed") == 2
