"""Upstream faults past the first byte and around it, through the real gateway with both of its
HTTP clients: what a replica's health learns, which time limit applies, what moves to another
replica, and what never reaches the caller (each case failed before its fix)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import FakeFactory, GatewayFactory, build_policy, serve, vllm

MESSAGES: Any = [{"role": "user", "content": "hi"}]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ANSWER = {
    "id": "x", "object": "chat.completion", "created": 1, "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


def chunk(text: str, finish: str | None = None) -> bytes:
    delta = {"content": text} if finish is None else {}
    event = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake-model",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def answer(request: web.Request, delay_s: float = 0.0) -> web.StreamResponse:
    """A well-formed answer, streamed or not as asked, after ``delay_s``."""
    body = await request.json()
    await asyncio.sleep(delay_s)
    if not body.get("stream"):
        return web.json_response(ANSWER)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk("fine") + chunk("", "stop") + b"data: [DONE]\n\n")
    return resp


async def _healthy(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class Upstreams:
    """Raw upstreams on loopback, each answering with its own handler; counts requests."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.hits: dict[str, int] = {}

    async def start(self, name: str, handler: Handler) -> str:
        self.hits[name] = 0

        async def counted(request: web.Request) -> web.StreamResponse:
            self.hits[name] += 1
            return await handler(request)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", counted)
        app.router.add_get("/health", _healthy)
        runner, url = await serve(app, handler_cancellation=True)  # a dropped request ends
        self.runners.append(runner)
        return url


@pytest.fixture
async def upstreams() -> Any:
    made = Upstreams()
    yield made
    for runner in made.runners:
        await runner.cleanup()


def pool(*urls: str, **settings: Any) -> str:
    return build_policy({"up": vllm(*urls, **settings)}, {"m": {"backend": "up", "model": "x"}})


async def ask(gw: Any, stream: bool, surface: str | None = None) -> int:
    """The status a raw client sees; a stream that ends in an error event counts as 502."""
    headers = {"X-Surface": surface} if surface else {}
    body = {"model": "m", "messages": MESSAGES, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.base_url + "/chat/completions", json=body, headers=headers) as resp,
    ):
        data = await resp.read()
    if resp.status == 200 and stream and (b'"error"' in data or b"[DONE]" not in data):
        return 502
    return resp.status


@pytest.mark.parametrize("fault", ["drop_mid_stream", "html_answer", "silent_after_head"])
async def test_a_replica_that_fails_after_its_headers_is_ejected(
    make_gateway: GatewayFactory, upstreams: Upstreams, fault: str
) -> None:
    async def sick(request: web.Request) -> web.StreamResponse:
        await request.read()
        if fault == "html_answer":
            return web.Response(text="<html>oops</html>", content_type="text/html")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("half"))
        if fault == "drop_mid_stream":
            assert request.transport is not None
            request.transport.close()
        else:
            await asyncio.sleep(5)
        return resp

    bad = await upstreams.start("sick", sick)
    good = await upstreams.start("well", answer)
    gw = await make_gateway(
        pool(bad, good, health={"eject_after": 2, "cooldown_s": 60}, timeouts={"idle_s": 0.3})
    )
    statuses = [await ask(gw, stream=fault != "html_answer") for _ in range(8)]
    # Before: the headers counted as a success, so the sick replica took every other request.
    assert upstreams.hits["sick"] == 2, statuses
    assert statuses.count(200) == 6
    sick_replica = next(r for r in gw.runtime.pools["up"].replicas if r.base_url == bad)
    assert not sick_replica.healthy and sick_replica.last_error


async def test_a_surface_deadline_does_not_eject_a_healthy_replica(
    make_gateway: GatewayFactory, upstreams: Upstreams
) -> None:
    url = await upstreams.start("slow", lambda r: answer(r, delay_s=0.5))
    surface = {"match": {"header": "fast"}, "budget": {"total_ms": 200},
               "actions": {"deadline": True}}  # fmt: skip
    policy = build_policy(
        {"up": vllm(url, health={"eject_after": 3})},
        {"m": {"backend": "up", "model": "x"}},
        surfaces={"fast": surface},
    )
    gw = await make_gateway(policy)
    assert [await ask(gw, False, "fast") for _ in range(3)] == [504, 504, 504]
    # The caller's own budget ran out, not the replica: the next caller is served.
    assert await ask(gw, False) == 200


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
async def test_the_head_may_take_first_byte_s_and_the_body_idle_s(
    make_gateway: GatewayFactory, upstreams: Upstreams, client: str
) -> None:
    # An API answering whole sends its head only when the answer is done: first_byte_s (3 s)
    # bounds that wait, not idle_s (0.4 s); aiohttp's read timeout applied idle_s to it.
    late = await upstreams.start("late", lambda r: answer(r, delay_s=1.0))

    async def stalls(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("half"))
        await asyncio.sleep(3)  # past idle_s, within first_byte_s and total_s
        return resp

    stalling = await upstreams.start("stalls", stalls)
    timeouts = {"first_byte_s": 3, "idle_s": 0.4, "total_s": 10}
    backends = {
        "late": vllm(late, http_client=client, timeouts=timeouts),
        "stalls": vllm(stalling, http_client=client, timeouts=timeouts),
    }
    models = {"m": {"backend": "late", "model": "x"}, "s": {"backend": "stalls", "model": "x"}}
    gw = await make_gateway(build_policy(backends, models))
    assert await ask(gw, stream=False) == 200
    assert await ask(gw, stream=True) == 200
    # ...while a body that stops coming still ends after idle_s, not after first_byte_s.
    loop = asyncio.get_running_loop()
    started = loop.time()
    stream = await gw.client.chat.completions.create(model="s", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError, match="stopped sending") as stopped:
        _ = [c async for c in stream]
    assert loop.time() - started < 2
    assert stopped.value.code == "idle_timeout"  # as the JSON answer for the same end says


async def test_a_stream_that_stops_coming_is_told_in_each_api_as_its_json_answer_is(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Past idle_s mid-stream: chat's error says timeout_error / idle_timeout; a Messages
    stream's error event says Anthropic's timeout_error, a Responses stream's the code
    idle_timeout (both said api_error / server_error, whatever had failed)."""
    slow = await make_fake(chunk_interval_ms=2000)  # a first chunk, then silence past idle_s
    backends = {"up": vllm(slow.url, timeouts={"idle_s": 0.3})}
    gw = await make_gateway(build_policy(backends, {"m": {"backend": "up", "model": "x"}}))
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError) as chat:
        _ = [c async for c in stream]
    assert (chat.value.type, chat.value.code) == ("timeout_error", "idle_timeout")
    async with anthropic.AsyncAnthropic(
        base_url=gw.root, api_key="unused", max_retries=0, timeout=20
    ) as claude:
        with pytest.raises(anthropic.APIStatusError) as messages:
            async with claude.messages.stream(model="m", max_tokens=8, messages=MESSAGES) as s:
                _ = [e async for e in s]
    assert messages.value.body == {
        "type": "error",
        "error": {"type": "timeout_error", "message": chat.value.message},
    }
    events = await gw.client.responses.create(model="m", input="hi", stream=True)
    told = {e.type: e async for e in events}
    error, failed = told["error"], told["response.failed"]
    assert error.type == "error" and failed.type == "response.failed"
    assert (error.code, error.message) == ("idle_timeout", chat.value.message)
    assert failed.response.error is not None
    assert (failed.response.error.code, failed.response.error.type) == (
        "server_error",
        "timeout_error",
    )


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A loopback address whose connections never complete: its accept queue is full, so the
    kernel drops further handshakes (a host that went away without a reset)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # the handshake is under way
            filler.connect(server.getsockname())
        fillers.append(filler)
    yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    for s in (*fillers, server):
        s.close()


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
async def test_a_connect_timeout_moves_to_another_replica(
    make_gateway: GatewayFactory, upstreams: Upstreams, black_hole: str, client: str
) -> None:
    good = await upstreams.start("well", answer)
    gw = await make_gateway(
        pool(
            black_hole,
            good,
            http_client=client,
            timeouts={"connect_s": 0.3},
            health={"active": False, "eject_after": 10},
        )
    )
    # Nothing was sent to the black hole: the request goes on to the other replica (a 504
    # before, after connect_s).
    assert [await ask(gw, stream=s) for s in (False, True, False, True)] == [200] * 4
    assert upstreams.hits["well"] == 4


async def test_a_rate_limited_hedge_does_not_win_the_race(
    make_gateway: GatewayFactory, upstreams: Upstreams
) -> None:
    arrivals = 0

    async def first_slow_then_limited(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals % 2 == 1:  # the primary: slow, then a good answer
            return await answer(request, delay_s=0.4)
        await request.read()  # the hedge: limited at once (for no longer: primaries take
        # turns, and a replica paced for its 429 would not be the next request's primary)
        return web.json_response(
            {"error": {"message": "slow down", "type": "rate_limit"}},
            status=429,
            headers={"Retry-After": "0"},
        )

    a = await upstreams.start("a", first_slow_then_limited)
    b = await upstreams.start("b", first_slow_then_limited)
    surface = {"match": {"header": "chat"}, "budget": {"ttft_ms": 5000},
               "actions": {"hedge": {"enabled": True, "delay_ms": 100, "max_fraction": 1.0}}}  # fmt: skip
    policy = build_policy(
        {"up": vllm(a, b)}, {"m": {"backend": "up", "model": "x"}}, surfaces={"chat": surface}
    )
    gw = await make_gateway(policy)
    # The hedge's 429 won before, and the primary's answer was thrown away.
    assert await ask(gw, stream=True, surface="chat") == 200
    assert await ask(gw, stream=False, surface="chat") == 200
    assert arrivals == 4  # each request was hedged


@pytest.mark.parametrize("client", ["aiohttp", "lean"])
@pytest.mark.parametrize("status", [204, 302, 307])
async def test_redirects_and_bodiless_statuses_never_reach_the_caller(
    make_gateway: GatewayFactory, upstreams: Upstreams, client: str, status: int
) -> None:
    canary = await upstreams.start("canary", answer)

    async def odd(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status == 204:
            return web.Response(status=204)
        return web.Response(status=status, headers={"Location": canary + "/chat/completions"})

    url = await upstreams.start("odd", odd)
    gw = await make_gateway(pool(url, http_client=client))
    for stream in (False, True):
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                gw.base_url + "/chat/completions",
                json={"model": "m", "messages": MESSAGES, "stream": stream},
                allow_redirects=False,
            ) as resp,
        ):
            body = await resp.json()
        assert resp.status in (502, 503), body  # 503: ejected by then
        assert "Location" not in resp.headers and "error" in body
    # A redirect followed would have sent the prompt to the address the upstream named.
    assert upstreams.hits["canary"] == 0


SMALL_TIER_FAULTS = ["down", "answers_400", "html_answer", "drops_mid_answer", "silent_after_head"]


@pytest.mark.parametrize("commit", ["whole", 2])
@pytest.mark.parametrize("fault", SMALL_TIER_FAULTS)
async def test_a_cascade_whose_small_tier_fails_is_answered_by_the_large_tier(
    make_gateway: GatewayFactory, upstreams: Upstreams, fault: str, commit: Any
) -> None:
    async def sick(request: web.Request) -> web.StreamResponse:
        stream = bool((await request.json()).get("stream"))
        if fault == "answers_400":
            error = {"error": {"message": "too long for me", "type": "invalid_request_error"}}
            return web.json_response(error, status=400)
        if fault == "html_answer":
            return web.Response(text="<html>oops</html>", content_type="text/html")
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream" if stream else "application/json"}
        )
        await resp.prepare(request)
        await resp.write(chunk("half") if stream else b'{"id": "x", "choi')
        if fault == "drops_mid_answer":
            assert request.transport is not None
            request.transport.close()
        else:
            await asyncio.sleep(5)
        return resp

    small = "http://127.0.0.1:9/v1" if fault == "down" else await upstreams.start("small", sick)
    large = await upstreams.start("large", answer)
    health = {"active": False, "eject_after": 2, "cooldown_s": 60}
    backends = {
        "small": vllm(small, health=health, timeouts={"idle_s": 0.3}),
        "large": vllm(large),
    }
    tiers = {"tiers": ["small", "large"], "mode": "cascade", "commit": {"tokens": commit}}
    gw = await make_gateway(build_policy(backends, {"auto": tiers}))
    body = {"model": "auto", "messages": MESSAGES, "stream": commit != "whole"}
    seen = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(gw.base_url + "/chat/completions", json=body) as resp:
                data = await resp.read()
                seen.append((resp.status, resp.headers.get("x-gateway-tier")))
            assert b"fine" in data and (b"[DONE]" in data or commit == "whole"), data
    # Before: 503 "the small tier answered 400", a 500 or an error event; a broken, silent or
    # non-JSON small answer was counted as the replica's success.
    assert seen == [(200, "large"), (200, "large")]
    replica = gw.runtime.pools["small"].replicas[0]
    to_blame = fault != "answers_400"  # a 4xx is the request's, never the replica's failure
    assert replica.healthy is not to_blame, replica.last_error


async def test_a_failed_hedge_is_counted_in_the_502(
    make_gateway: GatewayFactory, upstreams: Upstreams
) -> None:
    async def slow_then_500(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(0.3)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    a = await upstreams.start("a", slow_then_500)
    b = await upstreams.start("b", slow_then_500)
    surface = {"match": {"header": "chat"}, "budget": {"ttft_ms": 5000},
               "actions": {"hedge": {"enabled": True, "delay_ms": 100, "max_fraction": 1.0}}}  # fmt: skip
    policy = build_policy(
        {"up": vllm(a, b, health={"eject_after": 10})},
        {"m": {"backend": "up", "model": "x"}},
        surfaces={"chat": surface},
    )
    gw = await make_gateway(policy)
    with pytest.raises(openai.APIStatusError) as caught:
        await gw.client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
        )
    assert caught.value.status_code == 502
    assert upstreams.hits == {"a": 1, "b": 1}
    assert "(2 attempt(s))" in caught.value.message  # the hedge's failure was not counted
