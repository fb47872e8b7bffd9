"""Precise mode against a simulated vLLM replica's real ZMQ publisher (vLLM's wire format)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from bench.sim.kv_events import KvEventPublisher
from bench.sim.params import load_profile
from bench.sim.replica import SimReplica
from bench.sim.tokenizer import tokenize
from routing.kv_events import KVEventSource
from routing.kv_index import CallableTokenizer
from routing.load import BalanceSettings
from routing.prefix import PrecisePrefixRouter
from routing.prompt_text import render_for_routing
from routing.replica import Replica
from routing.router import RoutingRequest
from tests.routing.helpers import system_prompt


@pytest.fixture
async def sims() -> AsyncIterator[list[SimReplica]]:
    ctx = zmq.asyncio.Context()
    params = load_profile("h100-llama3-8b")
    replicas = [
        SimReplica(params, name=f"sim-{i}", time_scale=0.01, publisher=KvEventPublisher(ctx))
        for i in range(2)
    ]
    for r in replicas:
        await r.start()
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.stop()
        ctx.term()


async def serve(sim: SimReplica, text: str) -> None:
    async for _ in sim.submit(tokenize(text), max_tokens=4):
        pass


def chat(tenant: str, question: str) -> str:
    return render_for_routing(
        {
            "messages": [
                {"role": "system", "content": system_prompt(tenant, 3000)},
                {"role": "user", "content": question},
            ]
        }
    )


async def test_precise_router_follows_the_replicas_kv_events(sims: list[SimReplica]) -> None:
    pool = [Replica("sim", f"http://127.0.0.{i + 1}:8000/v1") for i in range(2)]
    sources = [
        KVEventSource(r.name, s.publisher.endpoint, s.publisher.replay_endpoint)
        for r, s in zip(pool, sims, strict=True)
        if s.publisher is not None
    ]
    router = PrecisePrefixRouter(
        CallableTokenizer(tokenize),
        sources=lambda _: sources,
        pending_ttl_s=0.0,  # only what the events report counts
        balance=BalanceSettings(epsilon=10, slack=100, max_waiting=None, max_kv_usage=None),
        load_smoothing_s=0.0,
    )
    await router.start(pool)
    try:
        # The prompt runs on sim-1 only; the router was told nothing about it.
        await serve(sims[1], chat("acme", "first question"))
        fillers = 0
        async with asyncio.timeout(10):
            while router.blocks.held_blocks(pool[1].name) < 100:
                # A later batch reveals a gap if the first one went out before the
                # subscription was up; the subscriber then replays it.
                await serve(sims[1], f"filler {fillers} " * 40)
                fillers += 1
                await asyncio.sleep(0.02)
        probe_text = chat("acme", "a different question")
        d = router.choose(pool, RoutingRequest("m", probe_text))
        assert d is not None
        assert d.replica is pool[1]
        assert d.reason == "prefix"
        assert d.matched_prefix >= 600  # ~3,000 characters of system prompt, in tokens
        cold = router.choose(pool, RoutingRequest("m", chat("other", "hello")))
        assert cold is not None and cold.reason == "cold" and cold.matched_prefix == 0
        sub = router.events.subscribers[pool[1].name]
        assert sub.stats.lost == 0
        assert sub.stats.errors == 0
        assert router.blocks.held_blocks(pool[0].name) == 0
    finally:
        await router.stop()
