"""Passive ejection as a circuit breaker, through the real gateway: after its cooldown an
ejected replica (or an external API's (replica, model) pair) takes one trial; a failed trial
ejects it again at once, for longer; a good one brings it back. Before the fix an ejected
replica was ejected once and then sent traffic for ever. And a vLLM replica's 429 binds that
replica only: the request moves on to another replica of the backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, build_policy, serve, vllm
from tests.e2e.test_upstream_faults import answer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Counted:
    """Upstreams on loopback, each with its own handler (a test may swap it); counts requests."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.hits: dict[str, int] = {}
        self.handlers: dict[str, Handler] = {}

    async def start(self, name: str, handler: Handler) -> str:
        self.hits[name] = 0
        self.handlers[name] = handler

        async def counted(request: web.Request) -> web.StreamResponse:
            self.hits[name] += 1
            return await self.handlers[name](request)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", counted)
        runner, url = await serve(app, handler_cancellation=True)
        self.runners.append(runner)
        return url


@pytest.fixture
async def counted() -> AsyncIterator[Counted]:
    made = Counted()
    yield made
    for runner in made.runners:
        await runner.cleanup()


async def failing(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"error": {"message": "boom", "type": "x"}}, status=500)


async def hanging(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(60)
    return web.Response()


async def status_of(gw: RunningGateway, model: str = "m") -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.base_url + "/chat/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status


# The first ejection's length; the next one after a failed trial is twice as long. Long enough
# that a slow machine's few requests inside one ejection never outlast it.
COOLDOWN_S = 1.0


def passive_pool(*urls: str, **timeouts: Any) -> str:
    backend = vllm(*urls, health={"active": False, "eject_after": 2, "cooldown_s": COOLDOWN_S})
    if timeouts:
        backend["timeouts"] = timeouts
    return build_policy({"up": backend}, {"m": {"backend": "up", "model": "x"}})


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_a_failed_trial_ejects_the_replica_again_at_once(
    make_gateway: GatewayFactory, counted: Counted, client: str
) -> None:
    bad = await counted.start("bad", failing)
    good = await counted.start("good", answer)
    policy = passive_pool(bad, good).replace("kind: vllm", f"kind: vllm\n    http_client: {client}")
    gw = await make_gateway(policy)
    while counted.hits["bad"] < 2:  # each 500 is retried on the good replica: all 200
        assert await status_of(gw) == 200
    [replica] = [r for r in gw.runtime.pools["up"].replicas if r.base_url == bad]
    assert not replica.healthy
    await asyncio.sleep(COOLDOWN_S + 0.05)  # past the cooldown: one trial, which fails
    loop = asyncio.get_running_loop()
    trial = loop.time()
    statuses = [await status_of(gw) for _ in range(8)]
    assert statuses == [200] * 8
    # Before: after the first cooldown the bad replica took every other request for ever.
    assert counted.hits["bad"] == 3
    # The second ejection is twice as long: still out a first cooldown after the trial.
    await asyncio.sleep(max(0.0, trial + 1.3 * COOLDOWN_S - loop.time()))
    assert [await status_of(gw) for _ in range(4)] == [200] * 4
    assert counted.hits["bad"] == 3
    await asyncio.sleep(max(0.0, trial + 2.05 * COOLDOWN_S - loop.time()))
    counted.handlers["bad"] = answer  # it recovered: the next trial brings it back
    while counted.hits["bad"] == 3:
        assert await status_of(gw) == 200
    assert replica.healthy and replica.ejected_at is None
    assert [await status_of(gw) for _ in range(4)] == [200] * 4
    assert counted.hits["bad"] >= 5  # it shares the work again


async def test_a_silent_replica_costs_one_time_out_per_cooldown(
    make_gateway: GatewayFactory, counted: Counted
) -> None:
    silent = await counted.start("silent", hanging)
    good = await counted.start("good", answer)
    gw = await make_gateway(passive_pool(silent, good, first_byte_s=0.2))
    statuses = []
    while counted.hits["silent"] < 2:
        statuses.append(await status_of(gw))
    assert statuses.count(504) == 2  # time-outs are not retried
    await asyncio.sleep(COOLDOWN_S + 0.05)
    # Half-open: requests at once, only one of them is the trial (the rest go to the good one).
    statuses = list(await asyncio.gather(*(status_of(gw) for _ in range(6))))
    assert counted.hits["silent"] == 3
    assert sorted(statuses) == [200] * 5 + [504]
    # Before: every other request after the first cooldown waited first_byte_s for a 504.
    statuses = [await status_of(gw) for _ in range(6)]
    assert statuses == [200] * 6 and counted.hits["silent"] == 3


async def test_a_failed_trial_ejects_a_model_of_an_external_api_again(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(models=("fake-model", "other-model"))
    backend = {
        "kind": "openai",
        "base_url": up.url,
        "health": {"active": False, "eject_after": 2, "cooldown_s": COOLDOWN_S},
    }
    models = {
        "a": {"backend": "ext", "model": "fake-model"},
        "b": {"backend": "ext", "model": "other-model"},
    }
    gw = await make_gateway(build_policy({"ext": backend}, models))
    up.fake.queue("status:500", "status:500")
    assert [await status_of(gw, "a") for _ in range(2)] == [502, 502]
    assert await status_of(gw, "a") == 503  # ejected for its cooldown
    assert await status_of(gw, "b") == 200
    up.fake.queue("status:500")
    sent = len(up.fake.requests)
    await asyncio.sleep(COOLDOWN_S + 0.05)
    assert await status_of(gw, "a") == 502  # the trial fails
    # Before: the pair stayed admitted after its first cooldown: every request went upstream.
    assert [await status_of(gw, "a") for _ in range(3)] == [503] * 3
    assert len(up.fake.requests) == sent + 1
    assert await status_of(gw, "b") == 200


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_a_429_from_one_vllm_replica_moves_on_to_another_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory, client: str
) -> None:
    limited, fine = await make_fake(), await make_fake()
    limited.fake.queue(*["ratelimit:30"] * 10)
    backend = vllm(limited.url, fine.url, http_client=client, routing={"strategy": "round_robin"})
    gw = await make_gateway(build_policy({"up": backend}, {"m": {"backend": "up"}}))
    # Before: a request routed to the limited replica got its 429 (the first relayed, the
    # next ones "every upstream of model 'm' is rate limited"); the other was never tried.
    assert [await status_of(gw) for _ in range(6)] == [200] * 6
    assert len(limited.fake.requests) == 1  # then left out while it asks to wait
    assert len(fine.fake.requests) == 6
    assert all(r.healthy for r in gw.runtime.pools["up"].replicas)  # a 429 is no failure


async def test_the_429_is_relayed_when_every_vllm_replica_is_limited(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a, b = await make_fake(), await make_fake()
    a.fake.queue("ratelimit:30")
    b.fake.queue("ratelimit:30")
    gw = await make_gateway(build_policy({"up": vllm(a.url, b.url)}, {"m": {"backend": "up"}}))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.base_url + "/chat/completions", json=body) as resp,
    ):
        answer = await resp.json()
    assert resp.status == 429 and answer["error"]["message"] == "Rate limit reached"
    assert len(a.fake.requests) == len(b.fake.requests) == 1
    # Both ask to wait 30 s: the gateway answers for them, sending nothing.
    assert await status_of(gw) == 429
    assert len(a.fake.requests) == len(b.fake.requests) == 1
