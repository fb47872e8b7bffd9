"""Hedging through the real gateway: where the hedge goes, and what a lost race teaches."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from routing.prefix import ApproximatePrefixRouter, text_chain
from routing.prompt_text import render_chat
from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningGateway,
    build_policy,
    pool_policy,
    vllm,
)

MESSAGES: Any = [{"role": "user", "content": "hi"}]
MODELS = {"m": {"backend": "up", "model": "fake-model"}}
# The hedge's delay: long enough that a loaded machine's fast replica answers within it (only
# requests on a slow replica are hedged), far below the slow replicas' latency.
SURFACE = """
  chat:
    match: {header: chat}
    budget: {ttft_ms: 2000}
    actions: {hedge: {enabled: true, delay_ms: 500, max_fraction: 1.0}}
"""


def policy(urls: list[str]) -> str:
    return pool_policy(urls, "surfaces:\n" + SURFACE)


async def streamed(gw: RunningGateway) -> Mapping[str, str]:
    """One hedgeable streamed request, read to its end: the answer's headers."""
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, stream=True, extra_headers={"X-Surface": "chat"}
    )
    _ = [c async for c in raw.parse()]
    return raw.headers


async def test_the_replica_that_lost_a_race_is_recorded_as_slow(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    slow = await make_fake(latency_ms=3000, chunks=2)
    fast = await make_fake(chunks=2)
    gw = await make_gateway(policy([slow.url, fast.url]))
    hedged = 0
    for _ in range(2):  # idle replicas take turns, so one request starts on the slow one
        headers = await streamed(gw)
        hedged += headers.get("x-gateway-hedge") == "hedge"
    assert hedged == 1
    latency = gw.runtime.latency
    predicted = latency.predict_ttft_ms(slow.url)
    fast_ms = latency.predict_ttft_ms(fast.url)
    # Cancelled about 500 ms in (the delay, then the fast replica's first chunk): its TTFT was
    # at least that, and the tracker knows it instead of seeing only what the slow one won.
    assert predicted is not None and predicted >= 450
    assert fast_ms is not None and fast_ms < predicted


async def test_the_hedge_avoids_a_replica_predicted_slow(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    slow_a = await make_fake(latency_ms=3000, chunks=2)
    slow_b = await make_fake(latency_ms=3000, chunks=2)
    fast = await make_fake(chunks=2)
    gw = await make_gateway(policy([slow_a.url, slow_b.url, fast.url]))
    latency = gw.runtime.latency
    for url, ttft in ((slow_a.url, 1500.0), (slow_b.url, 1500.0), (fast.url, 5.0)):
        for _ in range(20):
            latency.observe_ttft(url, ttft)
    names = {r.base_url: r.name for r in gw.runtime.pools["up"].replicas}
    for _ in range(3):  # each replica is the router's first choice once
        t0 = time.perf_counter()
        headers = await streamed(gw)
        if headers.get("x-gateway-hedge") is not None:
            assert headers["x-gateway-hedge"] == "hedge"
            assert headers["x-gateway-replica"] == f"up/{names[fast.url]}"
            assert time.perf_counter() - t0 < 2.0  # not the slow one's 3 s
    assert len(fast.fake.requests) == 3  # once as the primary, twice as the hedge


@pytest.mark.parametrize("strategy", ["round_robin", "least_loaded"])
async def test_a_hedge_does_not_steer_the_next_primary_onto_the_slow_replica(
    make_fake: FakeFactory, make_gateway: GatewayFactory, strategy: str
) -> None:
    """The hedge's replica is not asked of the router: asking moved its turn, so with two
    replicas every primary landed on the slow one and every request was hedged."""
    slow = await make_fake(latency_ms=1000, chunks=2)
    fast = await make_fake(chunks=2)
    surface = SURFACE.replace("delay_ms: 500", "delay_ms: 250")
    backend = vllm(slow.url, fast.url, routing={"strategy": strategy})
    gw = await make_gateway(build_policy({"up": backend}, MODELS, "surfaces:\n" + surface))
    hedged = 0
    for _ in range(6):
        headers = await streamed(gw)
        hedged += headers.get("x-gateway-hedge") is not None
    assert hedged == 3  # primaries take turns: only those on the slow replica are hedged
    assert len(slow.fake.requests) == 3


async def test_the_hedge_skips_a_replica_that_asked_to_wait(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A replica whose 429 asked for 30 s is left out of primaries, and of hedges too. Before:
    the hedge went to the least loaded other replica, the paced one included."""
    slow = await make_fake(latency_ms=1500, chunks=2)
    paced = await make_fake(chunks=2)
    fast = await make_fake(chunks=2)
    paced.fake.queue("ratelimit:30")
    backend = vllm(slow.url, paced.url, fast.url, routing={"strategy": "round_robin"})
    gw = await make_gateway(build_policy({"up": backend}, MODELS, "surfaces:\n" + SURFACE))
    hedged = 0
    for _ in range(4):
        headers = await streamed(gw)
        hedged += headers.get("x-gateway-hedge") == "hedge"
    assert len(paced.fake.requests) == 1  # its 429, moved on to another replica
    assert hedged >= 1  # a primary on the slow replica was hedged, on the fast one


async def test_with_a_prefix_router_the_hedge_goes_where_the_prefix_is_cached(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The primary goes to A, which holds the whole prompt's prefix; A is slow. C holds most of
    it, B none: the hedge asks the router (with nothing recorded) and goes to C. Before: the
    least loaded other replica, B (every replica idle: the first listed)."""
    slow_a = await make_fake(latency_ms=3000, chunks=2)
    cold_b = await make_fake(chunks=2)
    warm_c = await make_fake(chunks=2)
    backend = vllm(slow_a.url, cold_b.url, warm_c.url, routing={"strategy": "prefix"})
    gw = await make_gateway(build_policy({"up": backend}, MODELS, "surfaces:\n" + SURFACE))
    pool = gw.runtime.pools["up"]
    router = pool.router
    assert isinstance(router, ApproximatePrefixRouter)
    messages: Any = [
        {"role": "system", "content": "You answer questions about the tax code. " * 8},
        {"role": "user", "content": "What may a household deduct?"},
    ]
    chain = text_chain(render_chat(messages), router.chunks.chunk_chars)
    assert len(chain) >= 4
    names = {r.base_url: r.name for r in pool.replicas}
    router.chunks.record(names[slow_a.url], chain)
    router.chunks.record(names[warm_c.url], chain[:-2])
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=messages, stream=True, extra_headers={"X-Surface": "chat"}
    )
    _ = [c async for c in raw.parse()]
    assert raw.headers["x-gateway-hedge"] == "hedge"
    assert raw.headers["x-gateway-replica"] == f"up/{names[warm_c.url]}"
    assert (len(slow_a.fake.requests), len(cold_b.fake.requests)) == (1, 0)
    assert len(warm_c.fake.requests) == 1
