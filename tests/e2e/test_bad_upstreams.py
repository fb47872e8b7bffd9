"""Upstreams that compress, fail, lie or flood, through the real gateway and the openai client
(issue 12, items 1 to 5)."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, build_policy, serve, vllm

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def one_backend(url: str, client: str = "lean", **server: Any) -> str:
    return build_policy(
        {"up": vllm(url, http_client=client)},
        {"m": {"backend": "up", "model": "fake-model"}},
        server=server,
    )


# Both upstream clients: the gateway's lean one (routing/http1.py, vLLM's default) and aiohttp's.
CLIENTS = pytest.mark.parametrize("client", ["lean", "aiohttp"])


def uses(gw: RunningGateway, client: str) -> bool:
    pool = gw.runtime.pools["up"]
    return (pool.wire(pool.replicas[0]) is not None) == (client == "lean")


def external(url: str) -> str:
    """One OpenAI-compatible external backend (one replica) serving two models."""
    backend = {"kind": "openai", "base_url": url, "health": {"eject_after": 3, "cooldown_s": 30}}
    models = {
        "a": {"backend": "ext", "model": "fake-model"},
        "b": {"backend": "ext", "model": "other-model"},
    }
    return build_policy({"ext": backend}, models)


@CLIENTS
@pytest.mark.parametrize("stream", [False, True])
async def test_compressed_answers_reach_clients_intact(
    make_fake: FakeFactory, make_gateway: GatewayFactory, stream: bool, client: str
) -> None:
    up = await make_fake(gzip=True, chunks=5)
    gw = await make_gateway(one_backend(up.url, client))
    assert uses(gw, client)
    if not stream:
        r = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
        assert r.choices[0].message.content == "hello from the fake upstream"
        return
    text = ""
    async for chunk in await gw.client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True
    ):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == "tok0 tok1 tok2 tok3 tok4 "


async def test_failures_of_one_model_do_not_eject_the_other_models_of_its_backend(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(models=("fake-model", "other-model"))
    gw = await make_gateway(external(up.url))
    up.fake.queue("status:500", "status:500", "status:500")
    for _ in range(3):
        with pytest.raises(openai.InternalServerError) as info:
            await gw.client.chat.completions.create(model="a", messages=MESSAGES)
        assert info.value.status_code == 502
    # model b, on the same (only) replica, still answers
    r = await gw.client.chat.completions.create(model="b", messages=MESSAGES)
    assert r.choices[0].message.content
    # model a is out for its cooldown: a clear 503, the upstream is spared
    sent = len(up.fake.requests)
    with pytest.raises(openai.APIStatusError) as unavailable:
        await gw.client.chat.completions.create(model="a", messages=MESSAGES)
    assert unavailable.value.status_code == 503
    assert len(up.fake.requests) == sent
    # 4xx never eject: the caller's errors are not the upstream's health
    up.fake.queue(*["status:400"] * 5)
    for _ in range(5):
        with pytest.raises(openai.BadRequestError):
            await gw.client.chat.completions.create(model="b", messages=MESSAGES)
    r = await gw.client.chat.completions.create(model="b", messages=MESSAGES)
    assert r.choices[0].message.content


async def test_upstream_failures_name_no_internal_address(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    host_port = up.url.split("//")[1].removesuffix("/v1")
    for action in ("status:500", "drop"):
        up.fake.queue(action)
        with pytest.raises(openai.InternalServerError) as info:
            await gw.client.chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 502
        assert host_port not in str(info.value.body)
        assert "127.0.0.1" not in str(info.value.body)


@pytest.mark.parametrize("status", [401, 403])
async def test_upstream_refusing_the_gateways_key_is_a_502_for_the_caller(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    for stream in (False, True):
        up.fake.queue(f"status:{status}")
        with pytest.raises(openai.InternalServerError) as info:
            await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=stream)
        assert info.value.status_code == 502
        assert isinstance(info.value.body, dict)
        assert info.value.body["code"] == "upstream_auth_failed"
    assert any(r.levelno == logging.ERROR and "API key" in r.getMessage() for r in caplog.records)
    # a refused key says nothing of the replica's health
    assert all(r.healthy for r in gw.runtime.pools["up"].replicas)
    assert (await gw.client.chat.completions.create(model="m", messages=MESSAGES)).choices


@pytest.mark.parametrize("action", ["html", "truncated"])
@CLIENTS
async def test_a_200_that_is_no_answer_is_a_502(
    make_fake: FakeFactory, make_gateway: GatewayFactory, action: str, client: str
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url, client))
    assert uses(gw, client)
    up.fake.queue(action)
    with pytest.raises(openai.InternalServerError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 502
    assert isinstance(info.value.body, dict)
    assert info.value.body["type"] == "upstream_error"


@CLIENTS
async def test_answers_over_max_response_bytes_are_refused_not_buffered(
    make_fake: FakeFactory, make_gateway: GatewayFactory, client: str
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url, client, max_response_bytes=65536))
    assert uses(gw, client)
    up.fake.queue("big:1000", "big:200000")
    assert (await gw.client.chat.completions.create(model="m", messages=MESSAGES)).choices
    with pytest.raises(openai.InternalServerError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 502
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "response_too_large"


class Brotli:
    """An upstream that answers model ``fake-model`` in brotli whatever it was asked (as a
    misconfigured CDN might), other models plainly; it records each Accept-Encoding."""

    def __init__(self) -> None:
        self.accepted: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_get("/health", self.healthy)
        return app

    async def healthy(self, request: web.Request) -> web.Response:
        return web.Response()

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.accepted.append(request.headers.get("Accept-Encoding", ""))
        answer = {
            "id": "x", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "plain"}}],
        }  # fmt: skip
        if body["model"] != "fake-model":
            return web.json_response(answer)
        headers = {"Content-Type": "application/json", "Content-Encoding": "br"}
        return web.Response(body=b"\x1b\x2a\x00\xf8not really brotli", headers=headers)


@CLIENTS
async def test_an_answer_in_an_encoding_not_asked_for_is_a_bad_answer_not_a_connect_error(
    make_gateway: GatewayFactory, client: str
) -> None:
    brotli = Brotli()
    runner, url = await serve(brotli.app())
    try:
        gw = await make_gateway(one_backend(url, client))
        assert uses(gw, client)
        with pytest.raises(openai.InternalServerError) as info:
            await gw.client.chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 502
        # Before: "the upstream could not be reached", counted as a connect error.
        assert "could not be reached" not in info.value.message
        assert "Content-Encoding" in info.value.message
        assert all("br" not in accepted for accepted in brotli.accepted)  # never advertised
    finally:
        await runner.cleanup()


async def test_an_undecodable_answer_ejects_the_model_of_an_external_api_not_the_api(
    make_gateway: GatewayFactory,
) -> None:
    brotli = Brotli()
    runner, url = await serve(brotli.app())
    try:
        gw = await make_gateway(external(url))
        for _ in range(3):
            with pytest.raises(openai.InternalServerError):
                await gw.client.chat.completions.create(model="a", messages=MESSAGES)
        # Before: a connect error, so the whole API was ejected and model b got a 503.
        r = await gw.client.chat.completions.create(model="b", messages=MESSAGES)
        assert r.choices[0].message.content == "plain"
        with pytest.raises(openai.APIStatusError) as info:
            await gw.client.chat.completions.create(model="a", messages=MESSAGES)
        assert info.value.status_code == 503  # model a is out for its cooldown
    finally:
        await runner.cleanup()


async def test_a_failing_replica_is_logged_once_per_period_not_per_request(
    make_fake: FakeFactory, make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A replica failing every request under load wrote one WARNING per request: the log at
    # 3 a.m. was that line and nothing else. One line per replica and outcome every 10 s.
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    for _ in range(8):
        up.fake.queue("status:500")
        up.fake.queue("status:500")  # the retry meets the same replica (the only one)
        with pytest.raises(openai.APIStatusError):
            await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attempt on")]
    assert len(lines) == 1, lines


async def test_answers_a_replica_fails_are_logged_once_per_period_not_per_request(
    make_fake: FakeFactory, make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # After the headers, the relay's own warnings (an answer refused for its size, a 200 page
    # that is no JSON, a stream that broke) were one line per request: 497 in 22 minutes of a
    # soak. One line per replica and kind every 10 s, naming backend/replica.
    up = await make_fake()
    policy = build_policy(
        {"up": vllm(up.url, health={"eject_after": 100})},  # the replica stays in: each fails
        {"m": {"backend": "up", "model": "fake-model"}},
        server={"max_response_bytes": 4096},
    )
    gw = await make_gateway(policy)
    for action in ("big:200000", "html", "midstream_drop"):
        for _ in range(6):
            up.fake.queue(action)
            with pytest.raises(openai.APIError):
                if action != "midstream_drop":
                    await gw.client.chat.completions.create(model="m", messages=MESSAGES)
                    continue
                async for _chunk in await gw.client.chat.completions.create(
                    model="m", messages=MESSAGES, stream=True
                ):
                    pass
    relay = [r.getMessage() for r in caplog.records if r.name == "llm_gateway.relay"]
    where = "up/" + up.url.split("//")[1].split("/")[0]
    for what in ("was refused", "not a JSON object", "stream from"):
        lines = [line for line in relay if what in line]
        assert len(lines) == 1, (what, relay)
        assert where in lines[0] and "http" not in lines[0], lines[0]
