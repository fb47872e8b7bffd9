"""A client that closes its connection: after ``data: [DONE]`` the request succeeded (200),
before it the client left (499).

Clients may close the instant they read ``[DONE]`` (the openai sync client does), before the
gateway has read the upstream's end of body and sent its own. The fake upstream holds its end
back (``hold_end``), so the client's close always lands in that window. With aiohttp's handler
cancellation the close cancels the handler while it awaits the upstream's end; without it the
gateway's final write fails. Either way the request is counted once, as 200.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy

BODY: Any = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
HEDGED = """
surfaces:
  chat:
    match: {header: chat}
    actions: {hedge: {enabled: true, delay_ms: 200, max_fraction: 1.0}}
"""
BUDGETED = """
surfaces:
  chat:
    match: {header: chat}
    budget: {ttft_ms: 5000, total_ms: 60000}
"""


def counted(gw: RunningGateway) -> dict[str, float]:
    """``llm_gateway_requests_total`` by status."""
    out: dict[str, float] = {}
    for family in gw.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "llm_gateway_requests_total":
                status = sample.labels["status"]
                out[status] = out.get(status, 0.0) + sample.value
    return out


async def until_counted(gw: RunningGateway) -> dict[str, float]:
    for _ in range(200):
        if counted(gw):
            break
        await asyncio.sleep(0.01)
    return counted(gw)


@pytest.mark.parametrize("hedged", [False, True], ids=["plain", "hedged"])
@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["cancel", "no_cancel"])
async def test_client_closing_at_done_is_counted_as_200(
    make_fake: FakeFactory, make_gateway: GatewayFactory, hedged: bool, handler_cancellation: bool
) -> None:
    # Hedged: both replicas answer late (400 ms), so the hedge fires (at 200 ms) and the
    # primary still wins, by the hedge's delay (with 20 ms a loaded machine's hedge could win).
    fakes = [await make_fake(latency_ms=400 if hedged else 0) for _ in range(2)]
    for up in fakes:
        up.fake.queue("hold_end:0.3")
    gw = await make_gateway(
        pool_policy([f.url for f in fakes], HEDGED if hedged else ""),
        handler_cancellation=handler_cancellation,
    )
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.base_url + "/chat/completions", json=BODY, headers={"X-Surface": "chat"}
        )
        assert resp.headers.get("x-gateway-hedge") == ("primary" if hedged else None)
        async for line in resp.content:  # line by line
            if line == b"data: [DONE]\n":
                break
        resp.close()  # the whole answer read: the client closes at once
    assert await until_counted(gw) == {"200": 1.0}


@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["cancel", "no_cancel"])
async def test_client_leaving_before_done_is_counted_as_499(
    make_fake: FakeFactory, make_gateway: GatewayFactory, handler_cancellation: bool
) -> None:
    up = await make_fake(chunks=100, chunk_interval_ms=20)
    gw = await make_gateway(
        pool_policy([up.url], BUDGETED), handler_cancellation=handler_cancellation
    )
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            gw.base_url + "/chat/completions", json=BODY, headers={"X-Surface": "chat"}
        )
        await resp.content.readline()
        resp.close()  # the client goes away mid-stream
    # counted once, as the client's doing, with the replica that was serving it ...
    assert await until_counted(gw) == {"499": 1.0}
    replicas = {
        s.labels["replica"]
        for family in gw.metrics.registry.collect()
        for s in family.samples
        if s.name == "llm_gateway_requests_total"
    }
    assert replicas == {up.url.split("//")[1].removesuffix("/v1")}
    # ... and not charged to the surface's error budget as a server failure
    await asyncio.sleep(0.05)  # the cancelled handler's own cleanup
    assert gw.slo.view()["chat"]["errors"] == 0
