"""An upstream answer whose JSON strings are not valid Unicode (lone surrogates, written as
``\\ud800`` escapes, which ``json.loads`` accepts) through every surface the gateway has."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.fake_upstream import site_port
from gateway.observability.otlp import Encoder, Exporter
from gateway.observability.tracing import Telemetry
from tests.conftest import GatewayFactory, pool_policy

ODD = "\\ud800"  # as the upstream's bytes spell it: a JSON escape of a lone surrogate


def _odd(payload: dict[str, Any]) -> str:
    """``payload`` as JSON with each ``@`` written as a lone surrogate's escape."""
    return json.dumps(payload).replace("@", ODD)


def _answer(stream: bool) -> list[bytes]:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    head = {"id": "cmpl-@", "created": 1, "model": "fake-@"}
    if not stream:
        message = {"role": "assistant", "content": "a@b"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        return [_odd(answer).encode()]
    chunk = {**head, "object": "chat.completion.chunk"}
    deltas = [({"role": "assistant", "content": "a@"}, None), ({"content": "b"}, "stop")]
    events = [
        {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        for delta, finish in deltas
    ]
    events.append({**chunk, "choices": [], "usage": usage})
    return [f"data: {_odd(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


@pytest.fixture
async def odd_upstream() -> AsyncIterator[str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=_answer(False)[0], content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in _answer(True):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site_port(site)}/v1"
    await runner.cleanup()


# (path, body, how a whole streamed answer ends)
CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "data: [DONE]"),
    ("/v1/responses", {"input": "hi"}, '"type":"response.completed"'),
    (
        "/v1/messages",
        {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
        '"type":"message_stop"',
    ),
]


@pytest.mark.parametrize("cached", [False, True])
async def test_lone_surrogates_from_upstream_never_break_a_surface(
    odd_upstream: str, make_gateway: GatewayFactory, cached: bool
) -> None:
    """Each surface answers whole, streamed or not, live and (when cached) from the cache, and
    every span is exported."""
    exporter = Exporter(lambda batch: None, prepare=Encoder({"service.name": "t"}).span)
    telemetry = Telemetry(exporter, exporter=exporter)
    surfaces = {"default": {"cache": {"exact": True}}} if cached else {}
    gw = await make_gateway(pool_policy([odd_upstream], surfaces=surfaces), telemetry=telemetry)
    served: list[str] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # the second round is served from the cache when it is on
            for path, body, end in CALLS:
                for stream in (False, True):
                    async with session.post(
                        gw.root + path,
                        json={"model": "m", "stream": stream, "temperature": 0, **body},
                    ) as r:
                        text = await r.text()
                        assert r.status == 200, (path, stream, text)
                        assert "a\\ud800" in text, text  # the escape, passed on as it came
                        if stream:
                            assert end in text, text
                        else:
                            json.loads(text)
                        served.append(r.headers.get("x-gateway-cache", ""))
            if cached:
                await gw.runtime.cache.drain()  # type: ignore[union-attr]
        async with session.get(gw.root + "/metrics") as r:
            assert r.status == 200
    assert exporter.force_flush()
    assert exporter.dropped == 0
    assert exporter.exported >= 2 * len(served)  # each request's span and its attempts' or stage
    if cached:
        assert served[len(CALLS) * 2 :] == ["exact"] * (len(CALLS) * 2)
