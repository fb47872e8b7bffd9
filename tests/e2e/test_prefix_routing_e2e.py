"""The prefix strategies behind the gateway: bounded work per decision, what callers are told."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.kv_events import KvEventPublisher
from bench.sim.kvcache import BlockStored
from routing.kv_index import HFTokenizer
from routing.prefix import PrecisePrefixRouter
from routing.prompt_text import render_for_routing
from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm
from tests.routing.helpers import words, write_bpe_tokenizer
from tests.routing.kv_fakes import FakePublisher, block


def precise_policy(urls: list[str], tokenizer: Path, **sections: Any) -> str:
    routing = {"strategy": "prefix_precise", "tokenizer": str(tokenizer), "scrape_interval_s": 0}
    models = {"m": {"backend": "up", "model": "fake-model"}}
    return build_policy({"up": vllm(*urls, routing=routing)}, models, "", **sections)


async def test_a_huge_prompt_does_not_stall_other_requests(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """prefix_precise tokenizes on the event loop: a 2 MB prompt tokenized whole held every other
    request for seconds (about 4 s here); only its first ``max_prefix_chars`` are tokenized."""
    ups = [await make_fake(), await make_fake()]
    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    gw = await make_gateway(precise_policy([u.url for u in ups], tokenizer))
    small: Any = [{"role": "user", "content": "hello"}]
    huge: Any = [{"role": "user", "content": words(270_000)}]  # about 2 MB
    await gw.client.chat.completions.create(model="m", messages=small)  # warm
    slowest = 0.0
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal slowest
        while not done.is_set():
            t0 = time.perf_counter()
            await gw.client.chat.completions.create(model="m", messages=small)
            slowest = max(slowest, time.perf_counter() - t0)
            await asyncio.sleep(0.02)

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.1)
    answer = await gw.client.chat.completions.create(model="m", messages=huge)
    done.set()
    await poller
    assert answer.choices[0].message.content
    assert slowest < 1.5, slowest


async def test_route_details_reach_callers_only_when_the_policy_says(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The prefix index serves every tenant: its match length would tell a caller whether
    another tenant's prompt begins with a guess, one chunk at a time."""
    ups = [await make_fake(), await make_fake()]
    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    urls = [u.url for u in ups]
    cached = {"default": {"cache": {"exact": True}}}
    secret = words(200)

    def ask(question: str) -> Any:
        return [{"role": "system", "content": secret}, {"role": "user", "content": question}]

    for details in (False, True):
        policy = precise_policy(
            urls, tokenizer, server={"route_detail_headers": details}, surfaces=cached
        )
        gw = await make_gateway(policy)
        answers = [
            await gw.client.chat.completions.with_raw_response.create(
                model="m", messages=ask(question), temperature=0
            )
            for question in ("first?", "second?")
        ]
        assert gw.runtime.cache is not None
        await gw.runtime.cache.drain()
        hit = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=ask("second?"), temperature=0
        )
        assert hit.headers["x-gateway-cache"] == "exact"
        live = answers[1]
        assert live.headers["x-gateway-replica"].startswith("up/")  # kept: see README
        if details:
            assert live.headers["x-gateway-route-reason"] == "prefix"
            assert int(live.headers["x-gateway-prefix-match"]) > 0
            assert hit.headers["x-gateway-route-reason"] == "cache_exact"
        else:
            for answer in (*answers, hit):
                assert "x-gateway-route-reason" not in answer.headers
                assert "x-gateway-prefix-match" not in answer.headers


async def test_a_reload_that_adds_a_replica_keeps_what_the_index_knew(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A changed backend gets a new router: it used to start with an empty index, so a hot
    prefix went cold (and spread) until its replica's next KV event."""
    ups = [await make_fake() for _ in range(3)]
    ctx = zmq.asyncio.Context()
    publishers = [KvEventPublisher(ctx) for _ in ups]
    for publisher in publishers:
        await publisher.start()
    tokenizer_path = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "policy.yaml"

    def policy(n: int) -> str:
        routing = {
            "strategy": "prefix_precise",
            "tokenizer": str(tokenizer_path),
            "scrape_interval_s": 0,
            "pending_ttl_s": 0,  # only what the events report counts
            "kv_events": {
                "endpoints": {
                    u.url: {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint}
                    for u, p in zip(ups[:n], publishers, strict=False)
                }
            },
        }
        backend = vllm(*(u.url for u in ups[:n]), routing=routing)
        return build_policy({"up": backend}, {"m": {"backend": "up", "model": "fake-model"}})

    hot = words(300, seed=5)

    def ask(question: str) -> Any:
        return [{"role": "system", "content": hot}, {"role": "user", "content": question}]

    async def replica_of(question: str) -> str:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=ask(question)
        )
        return raw.headers["x-gateway-replica"]

    try:
        path.write_text(policy(2))
        gw = await make_gateway(path.read_text(), policy_path=path)
        router = gw.runtime.pools["up"].router
        assert isinstance(router, PrecisePrefixRouter)
        holder = gw.runtime.pools["up"].replicas[1]
        ids = HFTokenizer(tokenizer_path).encode(render_for_routing({"messages": ask("q")}))
        blocks = len(ids) // 16
        stored = BlockStored(list(range(1, blocks + 1)), None, ids[: blocks * 16], 16)
        await publishers[1].publish([stored])
        filler = 0
        async with asyncio.timeout(10):
            while router.blocks.held_blocks(holder.name) < blocks:
                # A batch after the first replays it, had it gone out before the subscription.
                filler += 1
                await publishers[1].publish([BlockStored([10_000 + filler], None, [0] * 16, 16)])
                await asyncio.sleep(0.02)
        assert await replica_of("before") == f"up/{holder.name}"

        path.write_text(policy(3))
        async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
            assert r.status == 200, await r.text()
        assert gw.runtime.pools["up"].router is not router  # a new router, no event since
        served = {await replica_of(f"after {i}") for i in range(4)}
        assert served == {f"up/{holder.name}"}
        # The new subscriber goes on from the old one's sequence number: no replay from 0.
        new = gw.runtime.pools["up"].router
        assert isinstance(new, PrecisePrefixRouter)
        stats = new.events.subscribers[holder.name].stats
        async with asyncio.timeout(10):
            while stats.batches == 0:
                filler += 1
                await publishers[1].publish([BlockStored([10_000 + filler], None, [0] * 16, 16)])
                await asyncio.sleep(0.02)
        assert stats.gaps == 0
        assert new.blocks.held_blocks(holder.name) >= blocks
    finally:
        for publisher in publishers:
            await publisher.close()
        ctx.term()


async def kv_batches(root: str) -> float | None:
    """``llm_gateway_kv_events_total{event="batches"}`` as scraped (None: no such series)."""
    async with aiohttp.ClientSession() as s, s.get(root + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llm_gateway_kv_events_total" and sample.labels["event"] == "batches":
                return sample.value
    return None


async def test_kv_event_counts_never_go_back_when_a_reload_rebuilds_the_router(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Any change to a backend (here its health interval) builds a new router, whose
    subscribers count from zero: the series went back (336 batches to 12), which Prometheus
    reads as a counter reset. So did a strategy changed away from prefix_precise and back."""
    up = await make_fake()
    ctx = zmq.asyncio.Context()
    fake = FakePublisher(ctx)
    replays = asyncio.create_task(fake.serve_replays())
    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "policy.yaml"

    def policy(strategy: str, interval_s: float) -> str:
        routing = {
            "strategy": strategy,
            "tokenizer": str(tokenizer),
            "scrape_interval_s": 0,
            "kv_events": {
                "endpoints": {
                    up.url: {"endpoint": fake.endpoint, "replay_endpoint": fake.replay_endpoint}
                }
            },
        }
        if strategy != "prefix_precise":
            routing = {"strategy": strategy, "scrape_interval_s": 0}
        backend = vllm(up.url, routing=routing, health={"interval_s": interval_s})
        return build_policy({"up": backend}, {"m": {"backend": "up", "model": "fake-model"}})

    async def reload(text: str) -> None:
        path.write_text(text)
        async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
            assert r.status == 200, await r.text()

    published = 0

    async def publish_until_counted(batches: int = 1) -> float:
        """Publish until the current router's subscriber (just connected) has applied
        ``batches``, then scrape."""
        nonlocal published
        router = gw.runtime.pools["up"].router
        assert isinstance(router, PrecisePrefixRouter)
        [sub] = router.events.subscribers.values()
        async with asyncio.timeout(10):
            while sub.stats.batches < batches:
                await fake.publish(published, [block(published + 1, None, "abcd")])
                published += 1
                await asyncio.sleep(0.02)
        scraped = await kv_batches(gw.root)
        assert scraped is not None
        return scraped

    try:
        path.write_text(policy("prefix_precise", 60))
        gw = await make_gateway(path.read_text(), policy_path=path)
        seen = [await publish_until_counted(5)]
        router = gw.runtime.pools["up"].router

        await reload(policy("prefix_precise", 30))  # only the health interval changed
        assert gw.runtime.pools["up"].router is not router
        seen.append(await publish_until_counted())

        await reload(policy("prefix", 30))  # no subscriber: no series, which is no reset
        assert await kv_batches(gw.root) is None
        await reload(policy("prefix_precise", 30))
        seen.append(await publish_until_counted())  # replays what came before: a new index
        assert seen == sorted(seen) and seen[1] > seen[0], seen
    finally:
        replays.cancel()
        fake.close()
        ctx.term()
