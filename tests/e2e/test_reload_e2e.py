"""Reloads rebuild what the policy decides, or refuse the new file with file:line errors."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    build_policy,
    closed_port_url,
    pool_policy,
    serve,
    vllm,
)
from tests.e2e.limits_helpers import chat, client, limits_policy, settled, usage_report
from tests.gateway.limits.conftest import Clock

MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]


async def reload(root: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(root + "/admin/reload") as r:
        return r.status, await r.text()


async def test_a_reload_that_adds_a_cache_takes_effect(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    up = await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(pool_policy([up.url]))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert gw.runtime.cache is None
    path.write_text(pool_policy([up.url], surfaces={"default": {"cache": {"exact": True}}}))
    status, text = await reload(gw.root)
    assert status == 200, text
    assert gw.runtime.cache is not None
    for _ in range(2):
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, temperature=0
        )
        await gw.runtime.cache.drain()
    assert raw.headers["x-gateway-cache"] == "exact"
    assert len(up.fake.requests) == 1
    # and a reload that removes it stops caching (and closes the old store)
    path.write_text(pool_policy([up.url]))
    assert (await reload(gw.root))[0] == 200
    assert gw.runtime.cache is None
    await gw.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    assert len(up.fake.requests) == 2


async def test_a_reload_that_repoints_an_alias_starts_a_new_cache_scope(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The cache scope holds what the alias resolves to (backend and upstream model), not
    only its name: the old model's answers are not served for the new one."""
    old, new = await make_fake(), await make_fake()
    backends = {"old": vllm(old.url), "new": vllm(new.url)}
    cached = {"default": {"cache": {"exact": True}}}
    path = tmp_path / "policy.yaml"
    path.write_text(
        build_policy(backends, {"m": {"backend": "old", "model": "fake-model"}}, surfaces=cached)
    )
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert gw.runtime.cache is not None
    await gw.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    await gw.runtime.cache.drain()
    path.write_text(
        build_policy(backends, {"m": {"backend": "new", "model": "fake-model"}}, surfaces=cached)
    )
    assert (await reload(gw.root))[0] == 200
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0
    )
    assert raw.headers["x-gateway-cache"] == "miss"
    assert len(old.fake.requests) == 1 and len(new.fake.requests) == 1
    await gw.runtime.cache.drain()
    again = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0
    )
    assert again.headers["x-gateway-cache"] == "exact"  # the new model's answer, cached


async def test_a_reload_naming_a_missing_artifact_is_refused(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    small, large = await make_fake(), await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(pool_policy([small.url]))
    gw = await make_gateway(path.read_text(), policy_path=path)
    backends = {"up": vllm(small.url), "large": {"kind": "openai", "base_url": large.url}}
    models = {
        "m": {"backend": "up", "model": "fake-model"},
        "auto": {"tiers": ["up", "large"], "artifact": "/nonexistent/difficulty.json"},
    }
    path.write_text(build_policy(backends, models))
    status, text = await reload(gw.root)
    assert status == 400
    assert f"{path}:" in text and "models.auto.artifact: cannot load the tier artifact" in text
    assert "auto" not in gw.runtime.policy.models  # the running policy is unchanged
    r = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert r.choices[0].message.content
    # The refusal shows in /metrics too (it was in the log and /admin/workers only), until a
    # good file is taken.
    assert await reload_metrics(gw.root) == (0.0, 1.0, 1.0)
    path.write_text(pool_policy([small.url]))
    assert (await reload(gw.root))[0] == 200
    assert await reload_metrics(gw.root) == (1.0, 1.0, 0.0)


async def reload_metrics(root: str) -> tuple[float, ...]:
    """Reloads accepted and rejected, and whether the last was rejected, as /metrics says."""
    async with aiohttp.ClientSession() as s, s.get(root + "/metrics") as r:
        lines = (await r.text()).splitlines()
    wanted = (
        'llm_gateway_policy_reloads_total{result="accepted"}',
        'llm_gateway_policy_reloads_total{result="rejected"}',
        "llm_gateway_policy_reload_failing",
    )
    values = dict(line.rsplit(" ", 1) for line in lines if not line.startswith("#"))
    return tuple(float(values[name]) for name in wanted)


async def test_a_reload_of_shared_state_keeps_the_limit_counters_and_in_flight_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Without Redis the counters live in the limiter's memory: a reload that changes how the
    store is used (here limits_failure_mode) keeps them, and a request in flight across it
    settles into the same store."""
    fake = await make_fake(chunks=50, chunk_interval_ms=20)  # team-b's stream lasts ~1 s
    rules = {"limits": {"requests_per_minute": 3}, "budget": {"usd": 0.04, "window": "day"}}
    path = tmp_path / "policy.yaml"
    path.write_text(limits_policy(fake.url, None, rules))
    gw = await make_gateway(path.read_text(), policy_path=path, clock=Clock())
    team_a, team_b = client(gw), client(gw, "team-b")
    try:
        # Each holds at most 0.019 USD (HELD): 0.017 of the 0.04 spent, 1 of 3 requests
        assert (await chat(team_a, max_tokens=6))[0] == 200
        await settled(gw)
        stream = await team_b.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        in_flight = asyncio.ensure_future(_drain(stream))
        path.write_text(limits_policy(fake.url, None, rules, failure_mode="closed"))
        status, text = await reload(gw.root)
        assert status == 200, text
        assert gw.runtime.limiter.fail_open is False  # the new setting applies
        assert not in_flight.done()
        status, headers, _ = await chat(team_a, max_tokens=6)
        assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1"
        await settled(gw)  # 0.034: the 0.006 left cannot cover another answer
        status, _, body = await chat(team_a, max_tokens=6)
        assert status == 429 and body["code"] == "insufficient_quota"
        assert await in_flight == 50
        await settled(gw)
        _, report = await usage_report(gw, tenant="team-b", window="day")
        assert report["requests"] == 1 and report["tokens"]["output"] == 50
    finally:
        await team_a.close()
        await team_b.close()


async def _drain(stream: Any) -> int:
    """The content chunks of a stream, read to its end."""
    return sum([1 async for chunk in stream if chunk.choices and chunk.choices[0].delta.content])


async def test_a_reload_whose_build_fails_unexpectedly_is_refused_and_logged(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any error while building the new runtime (here the JSON reader's RecursionError, which
    the artifact loader does not expect) is a rejection that says why: 400, never a 500; and
    a rejected POST /admin/reload is logged, as a rejected SIGHUP is."""
    small, large = await make_fake(), await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(pool_policy([small.url]))
    gw = await make_gateway(path.read_text(), policy_path=path)
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000)
    backends = {"up": vllm(small.url), "large": {"kind": "openai", "base_url": large.url}}
    models = {
        "m": {"backend": "up", "model": "fake-model"},
        "auto": {"tiers": ["up", "large"], "artifact": str(nested)},
    }
    path.write_text(build_policy(backends, models))
    with caplog.at_level(logging.ERROR, logger="llm_gateway"):
        status, text = await reload(gw.root)
    assert status == 400, text
    assert "cannot build the policy's runtime: RecursionError" in text
    assert gw.live.reload_error is not None and "RecursionError" in gw.live.reload_error
    assert "auto" not in gw.runtime.policy.models
    logged = [r for r in caplog.records if "POST /admin/reload" in r.getMessage()]
    assert logged and logged[0].levelno == logging.ERROR
    assert "RecursionError" in logged[0].getMessage()


def _bounded_policy(url: str, reload_no: int, max_connections: int, outstanding: int) -> str:
    """One replica; each ``reload_no`` changes the backend (its health interval), so a reload
    builds a new pool while the replaced one drains."""
    backend = vllm(url, max_connections=max_connections, health={"interval_s": 60 + reload_no})
    models = {"m": {"backend": "up", "model": "fake-model"}}
    admission = {"max_outstanding_per_replica": outstanding, "queue_timeout_s": 20}
    return build_policy({"up": backend}, models, admission=admission)


@pytest.mark.parametrize("bound", ["max_connections", "max_outstanding_per_replica"])
async def test_a_replicas_bounds_hold_across_reloads_under_held_streams(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path, bound: str
) -> None:
    """Each reload built a fresh pool (a new connection pool, a new admission queue) while
    the replaced one drained its streams: a replica capped at 2 served 2, 4, 6, 8 at once
    after reloads 0 to 3. The bound is the replica's: old and new pools count together."""
    up = await make_fake(chunks=12, chunk_interval_ms=100)  # a stream lasts ~1.2 s
    limits = (2, 1000) if bound == "max_connections" else (1000, 2)
    path = tmp_path / "policy.yaml"
    path.write_text(_bounded_policy(up.url, 0, *limits))
    gw = await make_gateway(path.read_text(), policy_path=path)
    streams: list[asyncio.Future[int]] = []
    for reload_no in range(1, 5):
        path.write_text(_bounded_policy(up.url, reload_no, *limits))
        status, text = await reload(gw.root)
        assert status == 200, text
        streams += [asyncio.ensure_future(_stream(gw)) for _ in range(3)]
        await asyncio.sleep(0.3)
    assert await asyncio.gather(*streams) == [12] * len(streams)
    assert up.fake.peak_active == 2


async def test_a_lowered_max_connections_bounds_the_draining_streams_too(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    up = await make_fake(chunks=12, chunk_interval_ms=100)
    path = tmp_path / "policy.yaml"
    path.write_text(_bounded_policy(up.url, 0, 2, 1000))
    gw = await make_gateway(path.read_text(), policy_path=path)
    held = [asyncio.ensure_future(_stream(gw)) for _ in range(2)]
    async with asyncio.timeout(10):
        while up.fake.active < 2:  # noqa: ASYNC110 (the fake upstream exposes no event)
            await asyncio.sleep(0.01)
    path.write_text(_bounded_policy(up.url, 1, 1, 1000))
    assert (await reload(gw.root))[0] == 200
    later = [asyncio.ensure_future(_stream(gw)) for _ in range(2)]
    assert await asyncio.gather(*held, *later) == [12] * 4
    assert up.fake.peak_active == 2  # the new pool waited for the old streams: never 3


async def _stream(gw: Any) -> int:
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    return await _drain(stream)


class Counted:
    """A replica on loopback that counts the requests it serves at once (``peak``). A request
    whose last message says ``HOLD`` is answered once the test sets ``gate``; one saying
    ``SLOW`` after ``slow_s``; any other at once."""

    def __init__(self, slow_s: float = 0.3) -> None:
        self.slow_s = slow_s
        self.gate = asyncio.Event()
        self.arrived = 0
        self.active = 0
        self.peak = 0
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> Counted:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner, self.url = await serve(app)
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        text = (await request.json())["messages"][-1]["content"]
        self.arrived += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if "HOLD" in text:
                await self.gate.wait()
            elif "SLOW" in text:
                await asyncio.sleep(self.slow_s)
        finally:
            self.active -= 1
        message = {"role": "assistant", "content": "ok"}
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "fake-model",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def until(self, arrived: int, within_s: float = 20.0) -> None:
        async with asyncio.timeout(within_s):
            while self.arrived < arrived:  # noqa: ASYNC110 (polled: no event to wait on)
                await asyncio.sleep(0.01)


CountedFactory = Callable[[], Awaitable[Counted]]


@pytest.fixture
async def counted() -> AsyncIterator[CountedFactory]:
    made: list[Counted] = []

    async def make() -> Counted:
        made.append(await Counted().start())
        return made[-1]

    yield make
    for up in made:
        up.gate.set()
        if up.runner is not None:
            await up.runner.cleanup()


async def _say(gw: Any, model: str, text: str) -> str:
    answer = await gw.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}]
    )
    return str(answer.choices[0].message.content)


def _one_url_two_backends(url: str, a_connections: int) -> str:
    backends = {"a": vllm(url, max_connections=a_connections), "b": vllm(url, max_connections=1)}
    models = {"ma": {"backend": "a", "model": "fake-model"}}
    models["mb"] = {"backend": "b", "model": "fake-model"}
    return build_policy(backends, models)


async def test_backends_naming_one_replica_keep_their_own_bounds_across_a_reload(
    counted: CountedFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Backends a (max_connections 8) and b (1) name the same replica URL. A reload that
    changes only a gave a's new pool b's connections (the last pool of the URL won) under a's
    limit: b's requests went 3 at once, and a and b counted one load. Each backend's state
    goes to its own new pool."""
    up = await counted()
    path = tmp_path / "policy.yaml"
    path.write_text(_one_url_two_backends(up.url, 8))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert await asyncio.gather(*(_say(gw, "mb", "SLOW") for _ in range(3))) == ["ok"] * 3
    assert up.peak == 1
    path.write_text(_one_url_two_backends(up.url, 9))  # a changes, b does not
    status, text = await reload(gw.root)
    assert status == 200, text
    up.peak = 0
    assert await asyncio.gather(*(_say(gw, "mb", "SLOW") for _ in range(3))) == ["ok"] * 3
    assert up.peak == 1  # b's max_connections 1 holds
    a, b = gw.runtime.pools["a"], gw.runtime.pools["b"]
    assert a.replicas[0].in_flight is not b.replicas[0].in_flight  # each counts its own load
    held = asyncio.ensure_future(_say(gw, "ma", "HOLD"))
    await up.until(up.arrived + 1)
    assert (a.replicas[0].outstanding, b.replicas[0].outstanding) == (1, 0)
    up.gate.set()
    assert await held == "ok"


def _readded_policy(url: str, max_connections: int) -> str:
    models = {"m": {"backend": "up", "model": "fake-model"}}
    return build_policy({"up": vllm(url, max_connections=max_connections)}, models)


async def test_a_replica_removed_and_added_back_keeps_its_bounds_while_it_drains(
    counted: CountedFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """X is removed by one reload and added back by the next while a request to it is still in
    flight through the pool of two reloads back: the new pool only saw the last runtime's
    pools, and sent a second request to X at once (2 in flight under max_connections 1).
    The connections and the load of X are the ones the draining pool holds."""
    x, y = await counted(), await counted()
    path = tmp_path / "policy.yaml"
    path.write_text(_readded_policy(x.url, 1))
    gw = await make_gateway(path.read_text(), policy_path=path)
    first = asyncio.ensure_future(_say(gw, "m", "HOLD"))
    await x.until(1)
    for url in (y.url, x.url):  # X removed (its pool drains the first request), then back
        path.write_text(_readded_policy(url, 1))
        status, text = await reload(gw.root)
        assert status == 200, text
    assert gw.runtime.pools["up"].replicas[0].outstanding == 1  # the first request counts
    second = asyncio.ensure_future(_say(gw, "m", "again"))
    with contextlib.suppress(TimeoutError):  # it must wait for the first one's connection
        await x.until(2, within_s=1.0)
    assert x.arrived == 1
    x.gate.set()
    assert list(await asyncio.gather(first, second)) == ["ok", "ok"]
    assert x.peak == 1


async def test_reloads_that_keep_changing_urls_leave_no_replica_state_behind(
    counted: CountedFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The per-replica state a backend's pools share across reloads is kept only while a pool
    holds it: after reloads to ever new URLs, only the serving pool's is left."""
    up = await counted()
    path = tmp_path / "policy.yaml"
    path.write_text(_readded_policy(up.url, 4))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert await _say(gw, "m", "hi") == "ok"
    for _ in range(8):
        path.write_text(_readded_policy(closed_port_url(), 4))
        status, text = await reload(gw.root)
        assert status == 200, text
    path.write_text(_readded_policy(up.url, 4))
    assert (await reload(gw.root))[0] == 200
    assert await _say(gw, "m", "hi") == "ok"
    states = gw.runtime.replica_states
    async with asyncio.timeout(20):  # the replaced pools' retirements end
        while len(states) > 2:
            await asyncio.sleep(0.05)
            gc.collect()
    assert len(states) == 2  # the serving pool's in-flight count and connection pool
