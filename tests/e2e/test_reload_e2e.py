"""Reloads rebuild what the policy decides, or refuse the new file with file:line errors."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, vllm
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
