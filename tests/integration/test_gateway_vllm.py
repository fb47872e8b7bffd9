"""The gateway in front of two real vLLM CPU replicas (tiny random-weight Llama)."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest

from deploy.local.localpool import LocalVllmPool
from tests.conftest import GatewayFactory, RunningGateway, build_policy, vllm

pytestmark = pytest.mark.vllm

MESSAGES: Any = [{"role": "user", "content": "Tell me about the standard library."}]


def pool_policy(pool: LocalVllmPool) -> str:
    """The real replicas as one backend, scraped and health-checked every second."""
    routing = {"strategy": "least_loaded", "scrape_interval_s": 1.0}
    backend = vllm(*pool.replicas, health={"interval_s": 1}, routing=routing)
    return build_policy({"local": backend}, {"default": {"backend": "local"}})


async def replica_metric(root_url: str, name: str, label: str = "") -> float:
    """The sum of a replica's series `name`, only those whose labels hold `label` if given."""
    async with aiohttp.ClientSession() as s, s.get(root_url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
        if label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def wait_idle(roots: list[str]) -> None:
    """Until no replica runs a request: an earlier test's last request counts before this one."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = [await replica_metric(r, "vllm:num_requests_running") for r in roots]
        if not any(running):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"replicas still running requests: {running}")


@pytest.fixture
async def gw(vllm_pool: LocalVllmPool, make_gateway: GatewayFactory) -> RunningGateway:
    return await make_gateway(pool_policy(vllm_pool))


async def test_chat_and_completions_through_the_gateway(
    gw: RunningGateway, vllm_pool: LocalVllmPool
) -> None:
    model = vllm_pool.model_name
    ids = [m.id for m in (await gw.client.models.list()).data]
    assert ids == ["default", model]
    chat = await gw.client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.model == model
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    again = await gw.client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == chat.choices[0].message.content  # deterministic
    stream = await gw.client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks, pieces, usage = 0, [], None
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12
    # vLLM may put several tokens in one delta; the stream still has a role chunk, content,
    # a finish chunk and the usage chunk.
    assert chunks >= 3
    assert "".join(pieces)
    text = await gw.client.completions.create(
        model="default",
        prompt="def main():",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text.usage is not None and text.usage.completion_tokens == 6
    cstream = await gw.client.completions.create(
        model="default",
        prompt="import os",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    cchunks = [c async for c in cstream]
    # a busy engine may put all five tokens in one chunk (CI saw it): 1 to 5 chunks of text, the
    # last one saying the length limit ended it, then the usage chunk counting all five
    assert len(cchunks) >= 2
    assert "".join(c.choices[0].text for c in cchunks if c.choices)
    assert [c.choices[0].finish_reason for c in cchunks if c.choices][-1] == "length"
    assert cchunks[-1].usage is not None and cchunks[-1].usage.completion_tokens == 5


async def test_load_is_spread_and_metrics_are_exported(
    gw: RunningGateway, vllm_pool: LocalVllmPool
) -> None:
    async def one(i: int) -> str:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="default",
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=32,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in raw.parse():
            pass
        return raw.headers["x-gateway-replica"]

    used = await asyncio.gather(*(one(i) for i in range(6)))
    assert len(set(used)) == 2  # least outstanding: both replicas served
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        text = await r.text()
    for url in vllm_pool.replicas:
        replica = url.split("//")[1].removesuffix("/v1")
        assert (
            f'llm_gateway_time_to_first_token_seconds_count{{backend="local",model="default",replica="{replica}"}}'
            in text
        )
    served = [
        await replica_metric(u.removesuffix("/v1"), "vllm:request_success_total")
        for u in vllm_pool.replicas
    ]
    assert all(n >= 1 for n in served)


async def test_client_disconnect_aborts_the_request_in_vllm(
    gw: RunningGateway, vllm_pool: LocalVllmPool
) -> None:
    body = {
        "model": "default",
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
    }
    # vLLM counts a request that ran to its 1,500 tokens under finished_reason="length" and one
    # aborted by its client under no reason at all; only "length" would show the abort was lost.
    ran_out = 'finished_reason="length"'
    await wait_idle([u.removesuffix("/v1") for u in vllm_pool.replicas])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.base_url + "/chat/completions", json=body)
        assert resp.status == 200
        replica = resp.headers["x-gateway-replica"].split("/", 1)[1]
        root = f"http://{replica}"
        finished_before = await replica_metric(root, "vllm:request_success_total", ran_out)
        for _ in range(3):
            await resp.content.readline()
        seen_running = False
        for _ in range(40):  # vLLM publishes its gauges a little after the first tokens
            if await replica_metric(root, "vllm:num_requests_running") == 1:
                seen_running = True
                break
            await asyncio.sleep(0.05)
        resp.close()  # the client goes away
        closed_at = time.monotonic()
    while time.monotonic() - closed_at < 5:
        if await replica_metric(root, "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - closed_at
    assert await replica_metric(root, "vllm:num_requests_running") == 0
    if seen_running:
        assert elapsed < 1.5, f"vLLM still ran the request {elapsed:.2f}s after the client left"
    await asyncio.sleep(0.5)
    finished = await replica_metric(root, "vllm:request_success_total", ran_out)
    assert finished == finished_before, f"ran to its end ({seen_running=}, {elapsed=:.2f})"
    assert gw.runtime.pools["local"].replicas[0].outstanding == 0
