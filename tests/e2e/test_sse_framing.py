"""Upstream streams in any valid SSE framing, and stream requests answered with no stream,
through the real gateway: ``data:`` without its space (HF TGI), ``\\r\\n`` or ``\\r`` line
ends (sse-starlette), data over several lines, an event that never ends, a whole JSON answer
or an HTML page where a stream was asked for (each case failed before its fix)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import GatewayFactory, RunningGateway, build_policy, serve, vllm

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]
MESSAGES: Any = [{"role": "user", "content": "hi"}]
ANSWER = {
    "id": "x", "object": "chat.completion", "created": 1, "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "one two"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}  # fmt: skip
# The request each client API sends, and how its stream's text is spelled.
ASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True}),
    "messages": (
        "/v1/messages",
        {"model": "m", "max_tokens": 50, "messages": MESSAGES, "stream": True},
    ),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake-model",
            "choices": [choice]}  # fmt: skip


USAGE_CHUNK = {**_chunk({}), "choices": [], "usage": ANSWER["usage"]}


def events(variant: str) -> list[bytes]:
    """A stream saying "one two", in one of SSE's valid spellings."""
    end, space = {"crlf": (b"\r\n", b" "), "cr": (b"\r", b" "), "no_space": (b"\n", b"")}.get(
        variant, (b"\n", b" ")
    )
    objs = [_chunk({"role": "assistant", "content": "one "}), _chunk({"content": "two"})]
    objs += [_chunk({}, "stop"), USAGE_CHUNK]
    out = [b"data:" + space + json.dumps(o).encode() + end + end for o in objs]
    if variant == "multi_line":  # the spec joins an event's data lines with "\n"
        text = json.dumps(objs[1]).replace(', "choices"', ',\ndata: "choices"')
        out[1] = b"data: " + text.encode() + b"\n\n"
    return [*out, b"data:" + space + b"[DONE]" + end + end]


async def _healthy(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def upstream() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        app.router.add_get("/health", _healthy)
        runner, url = await serve(app, handler_cancellation=True)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


def streams(parts: list[bytes], go: asyncio.Event | None = None) -> Handler:
    """Writes the first part, waits for ``go`` (if given), then the rest."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(parts[0])
        if go is not None:
            await go.wait()
        for part in parts[1:]:
            await resp.write(part)
        return resp

    return handler


async def ask(gw: RunningGateway, api: str) -> tuple[int, str, bytes]:
    path, body = ASKS[api]
    headers = {"anthropic-version": "2023-06-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.root + path, json=body, headers=headers) as resp,
    ):
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def _text(api: str, data: bytes) -> str:
    """The text a client of ``api`` read from its stream."""
    key = {"chat": "content", "messages": "text", "responses": "delta"}[api]
    found = ""
    for event in data.decode().split("\n\n"):
        payload = "\n".join(ln[5:] for ln in event.split("\n") if ln.startswith("data:"))
        if not payload or "[DONE]" in payload:
            continue
        obj = json.loads(payload)
        if api == "chat":
            found += "".join(c["delta"].get(key) or "" for c in obj["choices"])
        elif obj.get("type") in ("content_block_delta", "response.output_text.delta"):
            found += obj["delta"][key] if api == "messages" else obj[key]
    return found


def _clean(data: bytes) -> bool:
    """No error event in any client API (a Response object's ``"error": null`` is none)."""
    return b'data: {"error"' not in data and b"event: error" not in data


def _policy(url: str, **server: Any) -> str:
    models = {"m": {"backend": "up", "model": "fake-model"}}
    backends = {"up": vllm(url, health={"eject_after": 3})}
    if server:
        return build_policy(backends, models, server=server)
    return build_policy(backends, models)


@pytest.mark.parametrize("api", list(ASKS))
@pytest.mark.parametrize("variant", ["crlf", "cr", "no_space", "multi_line"])
async def test_every_valid_sse_framing_reaches_every_client_api(
    make_gateway: GatewayFactory, upstream: Serve, variant: str, api: str
) -> None:
    # Before: "data:[DONE]" was "a stream that ended early" (an error event appended, a 502
    # counted, the replica ejected after 3); "\r\n" or "\r" line ends gave Messages and
    # Responses clients no text and an error; data over two lines lost that chunk's text.
    gw = await make_gateway(_policy(await upstream(streams(events(variant)))))
    for _ in range(4):
        status, ctype, data = await ask(gw, api)
        assert (status, ctype) == (200, "text/event-stream")
        assert _text(api, data) == "one two", data
        assert _clean(data), data
        if api == "chat":
            assert data.endswith(b"data: [DONE]\n\n") or data.endswith(b"data:[DONE]\n\n")
            assert b'"usage": {' not in data  # not asked for: taken out
    replica = gw.runtime.pools["up"].replicas[0]
    assert replica.healthy and replica.last_error is None


async def test_a_crlf_stream_reaches_the_client_as_it_comes(
    make_gateway: GatewayFactory, upstream: Serve
) -> None:
    # Before: the usage tap saw no "\n\n" and held the whole stream until its end.
    go = asyncio.Event()
    gw = await make_gateway(_policy(await upstream(streams(events("crlf"), go))))
    async with asyncio.timeout(10):
        stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        first = await anext(aiter(stream))
        go.set()  # the upstream sends the rest only once the first chunk reached the client
        rest = [chunk async for chunk in stream]
    assert first.choices[0].delta.content == "one "
    assert [c.choices[0].delta.content for c in rest if c.choices] == ["two", None]
    assert all(c.usage is None for c in rest)  # the usage chunk was not asked for


async def test_an_event_that_never_ends_fails_the_stream_and_counts_against_the_replica(
    make_gateway: GatewayFactory, upstream: Serve
) -> None:
    # Before: every reader kept the open event, re-copied on every read (32 MB took 3 s), and
    # memory grew with the stream. Now an event past the limit (here server.max_response_bytes)
    # ends the stream with an error event, a 502 against the replica.
    head = b'data: {"choices": [{"index": 0, "delta": {"content": "'
    parts = [head, *[b"x" * 1024] * 64, b'"}}]}\n\ndata: [DONE]\n\n']
    gw = await make_gateway(_policy(await upstream(streams(parts)), max_response_bytes=4096))
    for api in ASKS:
        status, _, data = await ask(gw, api)
        assert status == 200 and b"over 4096 bytes" in data, data[-300:]
        assert len(data) < 8192  # the open event never reached the client
    replica = gw.runtime.pools["up"].replicas[0]
    assert replica.last_error == "an SSE event that never ended" and not replica.healthy


@pytest.mark.parametrize("api", list(ASKS))
async def test_a_whole_json_answer_to_a_stream_request_is_sent_as_a_stream(
    make_gateway: GatewayFactory, upstream: Serve, api: str
) -> None:
    # A server that ignores "stream". Before: committed as 200 with the upstream's
    # Content-Type (a Messages stream went out as application/json), the JSON relayed raw and
    # an error event appended.
    async def whole(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    gw = await make_gateway(_policy(await upstream(whole)))
    status, ctype, data = await ask(gw, api)
    assert (status, ctype) == (200, "text/event-stream")
    assert _text(api, data) == "one two" and _clean(data), data
    assert gw.runtime.pools["up"].replicas[0].last_error is None


async def test_json_that_is_no_answer_to_a_stream_request_is_a_502(
    make_gateway: GatewayFactory, upstream: Serve
) -> None:
    async def odd(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"object": "list", "data": []})

    gw = await make_gateway(_policy(await upstream(odd)))
    status, _, data = await ask(gw, "chat")
    assert status == 502 and b"not an answer" in data
    assert gw.runtime.pools["up"].replicas[0].last_error is not None


async def test_an_html_page_to_a_stream_request_moves_to_another_replica(
    make_gateway: GatewayFactory, upstream: Serve
) -> None:
    # A proxy's page where a stream was asked for: no byte went to the client yet, so another
    # replica answers; the page counts against its replica. Before: a 200 carrying the page
    # under text/html, then an error event.
    async def page(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html")

    sick = await upstream(page)
    good = await upstream(streams(events("plain")))
    policy = build_policy(
        {"up": vllm(sick, good, health={"eject_after": 2, "cooldown_s": 60})},
        {"m": {"backend": "up", "model": "fake-model"}},
    )
    gw = await make_gateway(policy)
    for _ in range(4):
        status, ctype, data = await ask(gw, "chat")
        assert (status, ctype) == (200, "text/event-stream") and _text("chat", data) == "one two"
    replica = next(r for r in gw.runtime.pools["up"].replicas if r.base_url == sick)
    assert not replica.healthy and "stream request" in (replica.last_error or "")
