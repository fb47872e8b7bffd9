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

from tests.conftest import FakeFactory, GatewayFactory, build_policy, serve, vllm

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
