"""The relay on its own: one path for live attempts and finished answers.

A real aiohttp server calls ``relay``/``send_answer`` from its handler, with attempts opened to
the fake upstream: what the client receives, what the watchers saw, how the attempt ended.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from bench.fake_upstream import site_port
from gateway.observability.metrics import GatewayMetrics
from gateway.protocol.answers import render_json
from gateway.upstream.attempt import Attempt
from gateway.upstream.attempts import AttemptOpener
from gateway.upstream.relay import Relayed, RelayPlan, relay, response_headers, send_answer
from tests.conftest import FakeFactory, build_policy, vllm
from tests.gateway.conftest import RuntimeFactory, make_call

Serve = Callable[[web.Request], Awaitable[Relayed]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Serve], Awaitable[tuple[int, bytes, list[Relayed]]]]]:
    """Run ``handler`` behind a real server once; the client's status and body come back."""
    runners: list[web.AppRunner] = []

    async def run(handler: Serve) -> tuple[int, bytes, list[Relayed]]:
        done: list[Relayed] = []

        async def endpoint(request: web.Request) -> web.StreamResponse:
            relayed = await handler(request)
            done.append(relayed)
            return relayed.response

        app = web.Application()
        app.router.add_post("/", endpoint)
        runner = web.AppRunner(app)
        runners.append(runner)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{site_port(site)}/") as r,
        ):
            return r.status, await r.read(), done

    yield run
    for runner in runners:
        await runner.cleanup()


def plan(stream: bool, deadline: float | None = None, **more: Any) -> RelayPlan:
    return RelayPlan(
        stream=stream, chat=True, include_usage=False, deadline=deadline, headers={}, **more
    )


async def attempt_of(rt: Any, stream: bool) -> Attempt:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return await AttemptOpener(GatewayMetrics(lambda: [])).open(
        make_call(rt, body), rt.targets("m")
    )


def data_events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


async def test_a_stream_is_relayed_byte_for_byte_to_its_watchers(
    make_fake: FakeFactory, make_runtime: RuntimeFactory, serve: Any
) -> None:
    up = await make_fake(chunks=5, chunk_interval_ms=5)
    rt = await make_runtime(build_policy({"up": vllm(up.url)}, {"m": {"backend": "up"}}))
    attempt = await attempt_of(rt, stream=True)
    seen: list[bytes] = []
    gaps: list[float] = []
    status, body, done = await serve(
        lambda request: relay(
            request, attempt, plan(True, watchers=(seen.append,), on_gap=gaps.append)
        )
    )
    assert status == 200 and b"".join(seen) == body
    assert data_events(body)[-1] == "[DONE]"
    result = done[0].result
    assert result.status == 200 and result.first_at is not None and result.reads >= 1
    assert len(gaps) == result.reads - 1
    assert attempt.finished and attempt.decision.replica.outstanding == 0


async def test_past_the_deadline_a_stream_ends_as_at_max_tokens(
    make_fake: FakeFactory, make_runtime: RuntimeFactory, serve: Any
) -> None:
    up = await make_fake(chunks=50, chunk_interval_ms=20)
    rt = await make_runtime(build_policy({"up": vllm(up.url)}, {"m": {"backend": "up"}}))
    attempt = await attempt_of(rt, stream=True)
    deadline = time.perf_counter() + 0.2
    status, body, done = await serve(lambda request: relay(request, attempt, plan(True, deadline)))
    events = data_events(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert done[0].result.deadline_hit and done[0].result.status == 200
    assert up.fake.disconnected == 1  # the upstream was told by closing the connection
    assert attempt.decision.replica.outstanding == 0


async def test_a_json_answer_and_an_upstream_4xx_pass_as_they_came(
    make_fake: FakeFactory, make_runtime: RuntimeFactory, serve: Any
) -> None:
    up = await make_fake()
    rt = await make_runtime(build_policy({"up": vllm(up.url)}, {"m": {"backend": "up"}}))
    attempt = await attempt_of(rt, stream=False)
    status, body, done = await serve(lambda request: relay(request, attempt, plan(False)))
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]
    assert done[0].result.body == body
    up.fake.queue("status:422")
    attempt = await attempt_of(rt, stream=True)
    status, body, done = await serve(lambda request: relay(request, attempt, plan(True)))
    assert status == 422 and json.loads(body)["error"]["code"] == 422
    assert attempt.finished


async def test_a_finished_answer_goes_out_as_json_or_as_openai_chunks(serve: Any) -> None:
    answer = {
        "id": "a",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    raw = render_json(answer)
    status, body, _ = await serve(lambda request: send_answer(request, raw, plan(False)))
    assert status == 200 and json.loads(body) == answer
    seen: list[bytes] = []
    with_usage = RelayPlan(
        stream=True,
        chat=True,
        include_usage=True,
        deadline=None,
        headers={"x-a": "1"},
        watchers=(seen.append,),
    )
    status, body, done = await serve(lambda request: send_answer(request, raw, with_usage))
    events = data_events(body)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["total_tokens"] == 5
    assert b"".join(seen) == body
    assert not done[0].result.live


class _Answered:
    """What ``response_headers`` reads of an upstream answer: its headers."""

    def __init__(self, headers: list[tuple[str, str]]) -> None:
        self.headers = CIMultiDictProxy(CIMultiDict(headers))


def test_only_what_the_answer_is_reaches_the_client_whatever_the_case() -> None:
    upstream = _Answered(
        [
            ("server", "uvicorn"),  # vLLM's, in lower case
            ("date", "Tue, 24 Nov 2026 07:00:00 GMT"),
            ("Content-Length", "10"),
            ("transfer-encoding", "chunked"),
            ("X-Request-Id", "upstream-id"),
            ("x-ratelimit-remaining-requests", "99"),
            ("content-type", "application/json"),
            ("Retry-After", "3"),
            ("openai-processing-ms", "120"),
            # each of these was relayed: a cookie for the gateway's origin, an internal
            # address, a CORS grant past server.cors, hop-by-hop headers, the account's name
            ("Set-Cookie", "session=upstream"),
            ("Location", "http://10.0.0.7:8000/v1"),
            ("Access-Control-Allow-Origin", "*"),
            ("Connection", "X-Secret-Hop"),
            ("X-Secret-Hop", "1"),
            ("Proxy-Authenticate", "Basic"),
            ("Upgrade", "h2c"),
            ("openai-organization", "acme-corp"),
            ("cache-control", "max-age=3600"),
            ("x-custom", "dropped"),
        ]
    )
    headers = response_headers(upstream, {"x-request-id": "ours"})  # type: ignore[arg-type]
    assert headers == {
        "content-type": "application/json",
        "Retry-After": "3",
        "openai-processing-ms": "120",
        "x-request-id": "ours",
    }
