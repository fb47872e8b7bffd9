"""What bounds an upstream attempt: open connections per replica, and total_s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningGateway,
    build_policy,
    serve,
    vllm,
)

MESSAGES: Any = [{"role": "user", "content": "hi"}]


async def test_max_connections_caps_open_connections_per_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(latency_ms=150)
    models = {"m": {"backend": "up", "model": "fake-model"}}
    gw = await make_gateway(build_policy({"up": vllm(up.url, max_connections=2)}, models))
    results = await asyncio.gather(
        *(gw.client.chat.completions.create(model="m", messages=MESSAGES) for _ in range(6))
    )
    assert len(results) == 6
    assert up.fake.peak_active == 2  # the others waited for a connection of the two


@pytest.fixture
async def trickle() -> AsyncIterator[str]:
    """An upstream that answers at once and then never finishes its body."""

    async def endless(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stream = bool(body.get("stream"))
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream" if stream else "application/json"}
        )
        await resp.prepare(request)
        if not stream:
            await resp.write(b'{"id": "x", "object": "chat.completion", "choices": [')
        for i in range(10_000):
            if stream:
                delta = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [delta]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.05)
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    app.router.add_get("/health", health)
    runner, url = await serve(app, handler_cancellation=True)
    yield url
    await runner.cleanup()


def bounded(url: str) -> str:
    timeouts = {"first_byte_s": 1, "total_s": 1}
    backend = vllm(url, discover_models=False, timeouts=timeouts)
    return build_policy({"up": backend}, {"m": {"backend": "up"}})


async def test_total_s_ends_an_endless_stream_with_an_error_event(
    trickle: str, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(bounded(trickle))
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        async with s.post(gw.base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            text = await asyncio.wait_for(r.text(), 5)
    last = [line for line in text.splitlines() if line.startswith("data: ")][-1]
    error = json.loads(last[6:])["error"]
    assert error["type"] == "timeout_error" and error["code"] == "total_timeout"
    assert "[DONE]" not in text
    with pytest.raises(openai.APIError):  # the SDK raises on the error event
        stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        async for _ in stream:
            pass


async def test_total_s_ends_an_endless_json_answer_with_504(
    trickle: str, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(bounded(trickle))
    with pytest.raises(openai.APIStatusError) as info:
        await asyncio.wait_for(gw.client.chat.completions.create(model="m", messages=MESSAGES), 5)
    assert info.value.status_code == 504
    assert info.value.code == "total_timeout"


class Busy:
    """Two replicas; a request whose prompt is "long" streams until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.hits: list[int] = [0, 0]

    def app(self, index: int) -> web.Application:
        async def answer(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.hits[index] += 1
            if body["messages"][-1]["content"] != "long":
                return web.json_response(
                    {"id": "x", "object": "chat.completion", "created": 1, "model": "x",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "short"}}]}
                )  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "x",
                     "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await self.release.wait()
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        return app


async def _long_stream(url: str, started: asyncio.Event) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "long"}], "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/chat/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()
        started.set()
        await r.read()


async def _busy_pair(
    make_gateway: GatewayFactory, client: str
) -> tuple[Busy, list[tuple[web.AppRunner, str]], RunningGateway]:
    """Two replicas behind one connection each, round robin, ejected after one failure."""
    busy = Busy()
    runners = [await serve(busy.app(i)) for i in range(2)]
    urls = [url for _, url in runners]
    backend = vllm(
        *urls, max_connections=1, http_client=client,
        health={"active": False, "eject_after": 1, "cooldown_s": 60},
        timeouts={"first_byte_s": 0.4}, routing={"strategy": "round_robin"},
    )  # fmt: skip
    gw = await make_gateway(build_policy({"up": backend}, {"m": {"backend": "up"}}))
    return busy, runners, gw


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_a_busy_connection_pool_is_never_the_replicas_failure(
    make_gateway: GatewayFactory, client: str
) -> None:
    busy, runners, gw = await _busy_pair(make_gateway, client)
    streams: list[asyncio.Task[None]] = []
    try:
        for expected_hits in ([0, 1], [1, 1]):
            started = asyncio.Event()
            streams.append(asyncio.create_task(_long_stream(gw.base_url, started)))
            await asyncio.wait_for(started.wait(), 5)
            assert sorted(busy.hits) == expected_hits
        # Both replicas' one connection is busy: the gateway is saturated, the replicas are not.
        before = list(busy.hits)
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as info:
                await gw.client.chat.completions.create(model="m", messages=MESSAGES)
            # Before: 504 "the upstream did not answer in time", and each replica ejected.
            assert info.value.status_code == 503
            assert info.value.code == "upstream_saturated"
            assert info.value.response.headers["Retry-After"]
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
            async with s.post(gw.root + "/v1/messages", json=body) as r:
                assert r.status == 529  # the caller's API: Anthropic's overloaded_error
                assert (await r.json())["error"]["type"] == "overloaded_error"
                assert r.headers["Retry-After"]
        assert busy.hits == before  # nothing was sent
        assert all(r.healthy for r in gw.runtime.pools["up"].replicas)
        busy.release.set()
        await asyncio.gather(*streams)
        for _ in range(4):
            done = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
            assert done.choices[0].message.content == "short"
    finally:
        busy.release.set()
        for task in streams:
            task.cancel()
        for runner, _ in runners:
            await runner.cleanup()


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
async def test_a_replica_with_a_free_connection_is_preferred_to_a_wait(
    make_gateway: GatewayFactory, client: str
) -> None:
    busy, runners, gw = await _busy_pair(make_gateway, client)
    started = asyncio.Event()
    stream = asyncio.create_task(_long_stream(gw.base_url, started))
    try:
        await asyncio.wait_for(started.wait(), 5)
        free = busy.hits.index(0)
        # Round robin would send every other request to the busy replica, to wait in vain.
        for _ in range(4):
            r = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
            assert r.choices[0].message.content == "short"
        assert busy.hits[free] == 4
    finally:
        busy.release.set()
        await stream
        for runner, _ in runners:
            await runner.cleanup()
