"""The gateway in front of deterministic fake upstreams, called with the official openai client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import FakeFactory, GatewayFactory


def one_backend(url: str, extra: str = "", backend_extra: str = "") -> str:
    return f"""
backends:
  up:
    kind: vllm
    replicas: ["{url}"]
    health: {{interval_s: 60}}
    {backend_extra}
models:
  m: {{backend: up, model: fake-model}}
{extra}
"""


def two_replicas(url1: str, url2: str, health: str = "{interval_s: 60}") -> str:
    return f"""
backends:
  up:
    kind: vllm
    replicas: ["{url1}", "{url2}"]
    health: {health}
models:
  m: {{backend: up, model: fake-model}}
"""


MESSAGES: Any = [{"role": "user", "content": "hi"}]


async def test_chat_passes_every_field_through_untouched(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    await gw.client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=tools,
        tool_choice="auto",
        response_format={"type": "json_object"},
        logprobs=True,
        top_logprobs=2,
        n=2,
        stop=["\n\n"],
        seed=7,
        temperature=0.3,
        extra_body={"top_k": 5, "priority": 3, "vendor_field": {"a": [1, 2]}},
    )
    sent = up.fake.requests[-1].body
    assert sent["model"] == "fake-model"  # the alias is mapped to the upstream's name
    assert sent["tools"] == tools
    assert sent["tool_choice"] == "auto"
    assert sent["response_format"] == {"type": "json_object"}
    assert (sent["logprobs"], sent["top_logprobs"], sent["n"], sent["seed"]) == (True, 2, 2, 7)
    assert sent["stop"] == ["\n\n"]
    assert (sent["top_k"], sent["priority"]) == (5, 3)
    assert sent["vendor_field"] == {"a": [1, 2]}


async def test_raw_body_is_forwarded_byte_for_byte_when_model_is_not_renamed(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    raw = b'{"model": "fake-model",   "messages": [{"role":"user","content":"x"}], "z": 1.50}'
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + "/chat/completions",
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 200
    assert up.fake.requests[-1].body == json.loads(raw)


async def test_streaming_chat_relays_chunks_and_done(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=8)
    gw = await make_gateway(one_backend(up.url))
    stream = await gw.client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    texts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert texts == [f"tok{i} " for i in range(8)]
    assert usage is not None and usage.completion_tokens == 8
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        ) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        body = await r.read()
    assert body.endswith(b"data: [DONE]\n\n")


async def test_completions_streaming_and_not(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=3)
    gw = await make_gateway(one_backend(up.url))
    full = await gw.client.completions.create(model="m", prompt="once upon", max_tokens=5)
    assert full.choices[0].text == "hello from the fake upstream"
    stream = await gw.client.completions.create(model="m", prompt="once upon", stream=True)
    texts = [c.choices[0].text async for c in stream]
    assert texts == ["tok0 ", "tok1 ", "tok2 "]
    assert up.fake.requests[-1].path == "/v1/completions"


async def test_embeddings_are_proxied_and_models_can_be_retrieved(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    # The openai client asks for base64 by default and decodes it: the bytes pass untouched.
    out = await gw.client.embeddings.create(model="m", input=["one", "three"])
    assert [d.embedding for d in out.data] == [[3.0, 0.0, 0.5], [5.0, 1.0, 0.5]]
    assert out.usage.prompt_tokens == 8
    sent = up.fake.requests[-1]
    assert sent.path == "/v1/embeddings" and sent.body["model"] == "fake-model"
    floats = await gw.client.embeddings.create(model="m", input="abc", encoding_format="float")
    assert floats.data[0].embedding == [3.0, 0.0, 0.5]
    assert (await gw.client.models.retrieve("m")).id == "m"
    with pytest.raises(openai.NotFoundError) as missing:
        await gw.client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"


async def test_embeddings_bad_input_is_400_before_any_upstream_call(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    bad: list[dict[str, Any]] = [
        {"model": "m"},
        {"model": "m", "input": []},
        {"model": "m", "input": [1, "mixed"]},
        {"model": "m", "input": {"text": "x"}},
        {"model": "m", "input": "x", "stream": True},
    ]
    for body in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await gw.client.post("/embeddings", body=body, cast_to=object)
        assert err.value.param in ("input", "stream")
    assert up.fake.requests == []


async def test_models_lists_aliases_and_discovered_models(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(models=("fake-model", "other-model"))
    gw = await make_gateway(one_backend(up.url))
    ids = [m.id for m in (await gw.client.models.list()).data]
    assert ids == ["m", "fake-model", "other-model"]
    # a discovered model is served under its own name
    r = await gw.client.chat.completions.create(model="other-model", messages=MESSAGES)
    assert r.choices[0].message.content
    assert up.fake.requests[-1].body["model"] == "other-model"


async def test_alias_without_model_uses_the_first_served_model(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(models=("served-name",))
    policy = f"""
backends:
  up: {{kind: vllm, replicas: ["{up.url}"], health: {{interval_s: 60}}}}
models:
  default: {{backend: up}}
"""
    gw = await make_gateway(policy)
    await gw.client.chat.completions.create(model="default", messages=MESSAGES)
    assert up.fake.requests[-1].body["model"] == "served-name"


async def test_retry_on_another_replica_before_first_byte(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a = await make_fake()
    b = await make_fake()
    gw = await make_gateway(two_replicas(a.url, b.url))
    a.fake.queue("status:503")
    # Idle replicas take turns, so one of two requests meets a's 503 and is retried on b.
    results = [
        await gw.client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        for _ in range(2)
    ]
    assert all(r.http_response.status_code == 200 for r in results)
    assert not a.fake.script  # the 503 was served
    assert a.fake.completed + b.fake.completed == 2
    assert b.fake.completed >= 1


async def test_upstream_4xx_is_relayed_as_is(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    up.fake.queue("status:422")
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.body == {"message": "fake 422", "type": "fake_error", "code": 422}
    assert len(up.fake.requests) == 1  # a 4xx is the client's problem: no retry


async def test_5xx_after_retries_is_502(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a = await make_fake()
    b = await make_fake()
    gw = await make_gateway(two_replicas(a.url, b.url))
    a.fake.queue("status:500")
    b.fake.queue("status:500")
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 502
    assert info.value.body["type"] == "upstream_error"  # type: ignore[index]
    assert len(a.fake.requests) == 1 and len(b.fake.requests) == 1  # one try, one retry


async def test_connect_error_is_502(make_gateway: GatewayFactory) -> None:
    from tests.conftest import closed_port_url

    policy = one_backend(closed_port_url(), backend_extra="").replace(
        "health: {interval_s: 60}", "health: {active: false}"
    )
    gw = await make_gateway(policy)
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 502


async def test_no_healthy_replica_is_503_with_retry_after(make_gateway: GatewayFactory) -> None:
    from tests.conftest import closed_port_url

    gw = await make_gateway(one_backend(closed_port_url()))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES}) as r,
    ):
        assert r.status == 503
        assert r.headers["Retry-After"] == "2"
        body = await r.json()
    assert body["error"]["code"] == "no_healthy_replica"
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/readyz") as r:
        assert r.status == 503


async def test_upstream_timeout_is_504(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url, backend_extra="timeouts: {first_byte_s: 0.3}"))
    up.fake.queue("hang")
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 504
    assert info.value.body["type"] == "timeout_error"  # type: ignore[index]


async def test_fallback_backend_when_primary_has_no_healthy_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    from tests.conftest import closed_port_url

    ext = await make_fake(models=("big-model",))
    policy = f"""
backends:
  pool: {{kind: vllm, replicas: ["{closed_port_url()}"], health: {{interval_s: 60}}}}
  external: {{kind: openai, base_url: "{ext.url}"}}
models:
  m:
    backend: pool
    model: fake-model
    fallbacks: [{{backend: external, model: big-model}}]
"""
    gw = await make_gateway(policy)
    raw = await gw.client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert raw.headers["x-gateway-replica"].startswith("external/")
    assert ext.fake.requests[-1].body["model"] == "big-model"


async def test_an_openai_backend_with_a_health_block_is_not_checked_unless_asked(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Tuning passive ejection alone keeps active checks off: the API's /health (here a 503,
    as a missing one) never makes the backend unready."""
    ext = await make_fake()
    ext.fake.healthy = False
    policy = f"""
backends:
  external: {{kind: openai, base_url: "{ext.url}", health: {{eject_after: 5}}}}
models:
  m: {{backend: external, model: fake-model}}
"""
    gw = await make_gateway(policy)
    reply = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert reply.choices[0].message.content
    assert ext.fake.requests[-1].body["model"] == "fake-model"


async def test_error_after_stream_began_is_a_final_sse_error_event(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=6)
    gw = await make_gateway(one_backend(up.url))
    up.fake.queue("midstream_drop")
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    seen = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["tok0 ", "tok1 "]
    assert "upstream" in info.value.message
    assert info.value.code == "bad_gateway"  # a string, as the JSON answer's (not 502)


async def test_client_disconnect_closes_upstream_within_a_second(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=200, chunk_interval_ms=50)
    gw = await make_gateway(one_backend(up.url))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES, "stream": True},
        )
        await resp.content.readline()
        assert up.fake.active == 1
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if up.fake.active == 0:
            break
        await asyncio.sleep(0.01)
    assert up.fake.active == 0
    assert up.fake.disconnected == 1
    assert gw.runtime.pools["up"].replicas[0].outstanding == 0


async def test_client_disconnect_before_first_byte_cancels_upstream(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    up.fake.queue("hang")
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            s.post(gw.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
        )
        for _ in range(100):
            if up.fake.active:
                break
            await asyncio.sleep(0.01)
        task.cancel()
    for _ in range(100):
        if up.fake.active == 0:
            break
        await asyncio.sleep(0.01)
    assert up.fake.active == 0 and up.fake.disconnected == 1


async def test_least_outstanding_spreads_concurrent_streams(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a = await make_fake(chunks=20, chunk_interval_ms=10)
    b = await make_fake(chunks=20, chunk_interval_ms=10)
    gw = await make_gateway(two_replicas(a.url, b.url))

    async def one() -> str:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, stream=True
        )
        stream = raw.parse()
        async for _ in stream:
            pass
        return raw.headers["x-gateway-replica"]

    replicas = await asyncio.gather(*(one() for _ in range(8)))
    assert len(a.fake.requests) == 4 and len(b.fake.requests) == 4
    assert len(set(replicas)) == 2


async def test_passive_ejection_and_readmission(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a = await make_fake()
    b = await make_fake()
    gw = await make_gateway(two_replicas(a.url, b.url, "{interval_s: 60, eject_after: 2}"))
    pool = gw.runtime.pools["up"]
    ra = next(r for r in pool.replicas if r.base_url == a.url)
    a.fake.queue("status:500", "status:500", "status:500")
    for _ in range(6):
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert not ra.healthy  # ejected after two consecutive 5xx
    assert len(a.fake.requests) == 2  # no traffic after ejection
    await pool.refresh()  # an active check passes: re-admitted
    assert ra.healthy


async def test_active_health_check_takes_replica_out_and_back(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    a = await make_fake()
    b = await make_fake()
    gw = await make_gateway(two_replicas(a.url, b.url))
    pool = gw.runtime.pools["up"]
    a.fake.healthy = False
    await pool.refresh()
    for _ in range(4):
        await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert len(a.fake.requests) == 0 and len(b.fake.requests) == 4
    a.fake.healthy = True
    await pool.refresh()
    assert all(r.healthy for r in pool.replicas)


async def test_metrics_histograms_are_labelled(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=5)
    gw = await make_gateway(one_backend(up.url))
    stream = await gw.client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    async for _ in stream:
        pass
    with pytest.raises(openai.NotFoundError):
        await gw.client.chat.completions.create(model="nope", messages=MESSAGES)
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        text = await r.text()
    replica = up.url.split("//")[1].removesuffix("/v1")
    assert (
        f'llm_gateway_requests_total{{backend="up",model="m",replica="{replica}",status="200"}} 1.0'
        in text
    )
    assert (
        'llm_gateway_requests_total{backend="",model="unknown",replica="",status="404"} 1.0' in text
    )
    assert (
        f'llm_gateway_time_to_first_token_seconds_count{{backend="up",model="m",replica="{replica}"}} 1.0'
        in text
    )
    assert (
        f'llm_gateway_inter_token_latency_seconds_count{{backend="up",model="m",replica="{replica}"}}'
        in text
    )
    assert "llm_gateway_request_duration_seconds_bucket" in text
    assert f'llm_gateway_replica_healthy{{backend="up",replica="{replica}"}} 1.0' in text


async def test_health_and_ready(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake()
    gw = await make_gateway(one_backend(up.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.root + "/healthz") as r:
            assert r.status == 200
        async with s.get(gw.root + "/readyz") as r:
            assert r.status == 200
        up.fake.healthy = False
        await gw.runtime.pools["up"].refresh()
        async with s.get(gw.root + "/readyz") as r:
            assert r.status == 503
            assert (await r.json())["backends_without_healthy_replica"] == ["up"]
