"""Clients that leave at every point of a request, in each API: no traceback, no ERROR line, no
upstream connection left open (issue 12, item 12). Both of aiohttp's modes: handlers cancelled when the
client goes (what `serve` runs) and not cancelled (aiohttp's default, e.g. under gunicorn)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import pytest

from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm


@pytest.mark.parametrize("cancellation", [True, False])
async def test_client_disconnects_leave_no_error_and_no_open_upstream(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    cancellation: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    up = await make_fake(chunks=20, chunk_interval_ms=2, latency_ms=20)
    policy = build_policy(
        {"up": vllm(up.url)},
        {"m": {"backend": "up", "model": "fake-model"}},
        surfaces={"default": {"cache": {"exact": True}}},
    )
    gw = await make_gateway(policy, handler_cancellation=cancellation)
    port = int(gw.root.rsplit(":", 1)[1])
    rng = random.Random(12)

    async def leave(i: int) -> None:
        stream = rng.random() < 0.6
        question = f"q{i % 40}"
        apis: list[tuple[bytes, dict[str, Any]]] = [
            (b"/v1/chat/completions", {"messages": [{"role": "user", "content": question}]}),
            (b"/v1/responses", {"input": question, "store": True}),
            (b"/v1/messages", {"max_tokens": 16,
                               "messages": [{"role": "user", "content": question}]}),
        ]  # fmt: skip
        path, fields = rng.choice(apis)
        body = json.dumps({"model": "m", "stream": stream, "temperature": 0, **fields}).encode()
        raw = (
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path, len(body))
        ) + body
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        cut = rng.choice(["head", "body", "waiting", "answer"])
        if cut == "head":
            writer.write(raw[:20])
        elif cut == "body":
            writer.write(raw[:-5])
        else:
            writer.write(raw)
        await asyncio.sleep(0.001 if cut in ("head", "body") else rng.random() * 0.06)
        if rng.random() < 0.5:
            writer.transport.abort()  # a reset
        else:
            writer.close()  # a FIN

    for batch in range(8):
        await asyncio.gather(*(leave(batch * 40 + i) for i in range(40)))
    await asyncio.sleep(0.5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == [], [r.getMessage() for r in errors[:3]]
    assert up.fake.active == 0  # every upstream request ended: its connection was closed
    assert all(r.outstanding == 0 for r in gw.runtime.pools["up"].replicas)
    r = await gw.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "still here?"}]
    )
    assert r.choices[0].message.content


async def test_a_client_leaving_during_an_escalation_leaves_no_load(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The small answer was read whole and escalated past; the client leaves while the large
    tier is asked: neither tier's replica keeps counting the request."""
    small, large = await make_fake(reply=""), await make_fake(latency_ms=300)
    tiers = {"tiers": ["small", "large"], "mode": "cascade"}
    gw = await make_gateway(
        build_policy({"small": vllm(small.url), "large": vllm(large.url)}, {"m": tiers})
    )
    port = int(gw.root.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    loop = asyncio.get_running_loop()
    for i in range(3):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        # the small answer is in and the large tier asked, its answer 300 ms away (a bounded
        # wait: a fixed 0.1 s let a loaded machine's client leave before the escalation)
        deadline = loop.time() + 5
        while len(large.fake.requests) < i + 1:
            assert loop.time() < deadline, "the large tier was never asked"
            await asyncio.sleep(0.005)
        writer.transport.abort()
    assert len(small.fake.requests) == 3 and len(large.fake.requests) == 3
    deadline = loop.time() + 5  # the gateway notices each client left, then lets go

    def left() -> dict[str, int]:
        return {r.name: r.outstanding for p in gw.runtime.pools.values() for r in p.replicas}

    while set(left().values()) != {0} and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    assert set(left().values()) == {0}, left()
