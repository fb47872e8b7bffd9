"""RedisStore against a real redis-server: sharing, scope, TTL, eviction, outage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache.redis_store import RedisStore
from cache.semantic import ResponseCache
from policies.cache import CachePolicy, SemanticCacheConfig
from tests.cache.conftest import HashingEmbedder, RedisServer
from tests.cache.test_semantic import answer, chat, plan_for

pytestmark = pytest.mark.redis

POLICY = CachePolicy(semantic=SemanticCacheConfig(gate="cosine", threshold=0.8))


async def instance(server: RedisServer) -> ResponseCache:
    store = RedisStore(server.url, timeout_s=0.5, retry_after_s=0.2, block_ms=100)
    cache = ResponseCache(store, None)
    await cache.start()
    return cache


async def put(
    cache: ResponseCache, emb: HashingEmbedder, q: str, a: str, tenant: str = "t1"
) -> None:
    plan = plan_for(cache, chat(q), POLICY, tenant)
    await cache.fill(plan, POLICY, answer(a), emb.embed_sync([q])[0])


async def get(cache: ResponseCache, emb: HashingEmbedder, q: str, tenant: str = "t1") -> str | None:
    plan = plan_for(cache, chat(q), POLICY, tenant)
    hit = await cache.lookup(plan, POLICY, emb.embed_sync([q])[0])
    if hit is None:
        return None
    content: str = json.loads(hit.response)["choices"][0]["message"]["content"]
    return f"{hit.kind}:{content}"


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    """Wait for state another task produces (the stream follower), with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_second_instance_sees_entries_of_the_first(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    a = await instance(redis_server)
    await put(a, embedder, "how do I reset my password", "click reset")
    # Started after the store: finds the entry through its start-up load.
    b = await instance(redis_server)
    assert len(b.index) == 1
    assert await get(b, embedder, "how do I reset my password") == "exact:click reset"
    assert await get(b, embedder, "how do I reset my password please") == "semantic:click reset"
    # Running while the first stores: learns the entry from the event stream.
    await put(a, embedder, "where is the nearest station", "two blocks north")

    async def b_has_it() -> bool:
        return (
            await get(b, embedder, "where is the nearest station please")
            == "semantic:two blocks north"
        )

    await eventually(b_has_it)
    await a.aclose()
    await b.aclose()


async def test_scope_isolation_and_purge_across_instances(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    a = await instance(redis_server)
    b = await instance(redis_server)
    await put(a, embedder, "what is our refund policy", "30 days", tenant="acme")
    await put(a, embedder, "what is our refund policy", "no refunds", tenant="globex")
    await eventually(lambda: _ready(len(b.index) == 2))
    assert await get(b, embedder, "what is our refund policy please", tenant="acme") == (
        "semantic:30 days"
    )
    assert await get(b, embedder, "what is our refund policy please", tenant="globex") == (
        "semantic:no refunds"
    )
    assert await get(b, embedder, "what is our refund policy", tenant="initech") is None
    assert await b.purge("acme") == 2
    await eventually(lambda: _ready(len(a.index) == 1))
    assert await get(a, embedder, "what is our refund policy", tenant="acme") is None
    assert await get(a, embedder, "what is our refund policy", tenant="globex") == (
        "exact:no refunds"
    )
    await a.aclose()
    await b.aclose()


async def _ready(value: bool) -> bool:
    return value


async def test_ttl_expiry(redis_server: RedisServer, embedder: HashingEmbedder) -> None:
    short = CachePolicy(
        exact_ttl=1, semantic=SemanticCacheConfig(gate="cosine", threshold=0.8, ttl=1)
    )
    cache = await instance(redis_server)
    plan = plan_for(cache, chat("short lived question"), short)
    vec = embedder.embed_sync(["short lived question"])[0]
    await cache.fill(plan, short, answer("soon gone"), vec)
    assert await cache.lookup(plan, short, vec) is not None
    await asyncio.sleep(1.2)  # the TTL itself is what is under test
    assert await cache.lookup(plan, short, vec) is None
    await cache.aclose()


async def test_expired_entries_leave_every_index(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    """Redis expires an entry's hash silently; the next store in its scope reads the expired
    ids before removing them, so no instance's faiss index grows past what Redis holds."""
    short = CachePolicy(
        exact=False, semantic=SemanticCacheConfig(gate="cosine", threshold=0.95, ttl=1)
    )
    a = await instance(redis_server)
    b = await instance(redis_server)

    async def fill(q: str) -> None:
        await a.fill(plan_for(a, chat(q), short), short, answer(q), embedder.embed_sync([q])[0])

    for q in ("alpha question", "beta question", "gamma question"):
        await fill(q)
    await eventually(lambda: _ready(len(a.index) == len(b.index) == 3))
    await asyncio.sleep(1.2)  # the TTL itself is what is under test
    await fill("delta question")
    await eventually(lambda: _ready(len(a.index) == len(b.index) == 1))
    await a.aclose()
    await b.aclose()


async def test_expired_entries_of_a_quiet_scope_are_swept(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    short = CachePolicy(
        exact=False, semantic=SemanticCacheConfig(gate="cosine", threshold=0.95, ttl=1)
    )
    store = RedisStore(redis_server.url, timeout_s=0.5, block_ms=100, sweep_interval_s=0.1)
    cache = ResponseCache(store, None)
    await cache.start()
    for q in ("alpha question", "beta question"):
        vec = embedder.embed_sync([q])[0]
        await cache.fill(plan_for(cache, chat(q), short), short, answer(q), vec)
    assert len(cache.index) == 2
    await eventually(lambda: _ready(len(cache.index) == 0), timeout_s=5.0)  # no store since
    await cache.aclose()


async def test_max_entries_evicts_oldest_everywhere(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    small = CachePolicy(
        exact=False, semantic=SemanticCacheConfig(gate="cosine", threshold=0.95, max_entries=2)
    )
    a = await instance(redis_server)
    b = await instance(redis_server)
    for i, q in enumerate(["alpha question", "beta question", "gamma question"]):
        plan = plan_for(a, chat(q), small)
        await a.fill(plan, small, answer(str(i)), embedder.embed_sync([q])[0])
    await eventually(lambda: _ready(len(b.index) == 2))
    plan = plan_for(b, chat("alpha question"), small)
    assert await b.lookup(plan, small, embedder.embed_sync(["alpha question"])[0]) is None
    await a.aclose()
    await b.aclose()


async def test_redis_killed_mid_run_degrades_to_misses_then_recovers(
    redis_server: RedisServer, embedder: HashingEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    cache = await instance(redis_server)
    await put(cache, embedder, "what are your opening hours", "9 to 5")
    assert await get(cache, embedder, "what are your opening hours") == "exact:9 to 5"

    redis_server.stop()
    for _ in range(20):  # neither lookups nor fills raise; each is bounded in time
        started = time.monotonic()
        assert await get(cache, embedder, "what are your opening hours") is None
        await put(cache, embedder, "another question", "another answer")
        assert time.monotonic() - started < 2.0
    assert cache.stats.unavailable >= 20
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not per request

    redis_server.start()  # same port, empty: the old entries are gone

    async def works_again() -> bool:
        await put(cache, embedder, "what are your opening hours", "8 to 6")
        return await get(cache, embedder, "what are your opening hours") == "exact:8 to 6"

    await eventually(works_again)
    assert await get(cache, embedder, "what are your opening hours please") == "semantic:8 to 6"
    await cache.aclose()


async def _clients(server: RedisServer) -> int:
    """Connections Redis holds open, the one asking included."""
    admin = aioredis.Redis.from_url(server.url)
    try:
        return len(await admin.client_list())
    finally:
        await admin.aclose()


async def test_a_closed_store_leaves_no_connection_to_redis(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    """Its pool's connections close with it: a reload that changes ``cache_store`` replaces
    the store, and each replaced one kept a burst's worth of sockets (up to 64) open."""
    baseline = await _clients(redis_server)
    for round_no in range(3):
        cache = await instance(redis_server)
        questions = [f"question {round_no} number {i}" for i in range(20)]
        await asyncio.gather(*(put(cache, embedder, q, "an answer") for q in questions))
        assert await _clients(redis_server) > baseline + 2  # a burst opened several
        await cache.aclose()
        assert await _clients(redis_server) == baseline


async def _everything_in(server: RedisServer) -> list[bytes]:
    """Every value Redis holds, whatever its key's type (the stream's fields included)."""
    r = aioredis.Redis.from_url(server.url)
    out: list[bytes] = []
    try:
        async for key in r.scan_iter(count=1000):
            kind = await r.type(key)
            if kind == b"hash":
                found: Any = await r.hgetall(key)
                out += [k + b"=" + v for k, v in found.items()]
            elif kind == b"stream":
                events: Any = await r.xrange(key)
                out += [k + b"=" + v for _id, fields in events for k, v in fields.items()]
            elif kind == b"zset":
                members: Any = await r.zrange(key, 0, -1)
                out += members
            else:
                out.append(repr(await r.dump(key)).encode())
    finally:
        await r.aclose()
    return out


async def test_no_prompt_text_outlives_its_entry(
    redis_server: RedisServer, embedder: HashingEmbedder
) -> None:
    """The event stream, which has no TTL, carried each entry's text and vector: they stayed
    in Redis after the entry expired or was purged. It names the entry now; the other
    instance reads the entry itself."""
    short = CachePolicy(
        exact_ttl=1, semantic=SemanticCacheConfig(gate="cosine", threshold=0.8, ttl=1)
    )
    a = await instance(redis_server)
    b = await instance(redis_server)
    q1, q2 = "secret marker alpha question", "secret marker beta question"
    await a.fill(
        plan_for(a, chat(q1), short, "acme"), short, answer("a1"), embedder.embed_sync([q1])[0]
    )
    await put(a, embedder, q2, "b2", tenant="globex")

    async def b_learned_both() -> bool:
        hits = [
            await get(b, embedder, "secret marker alpha question please", tenant="acme"),
            await get(b, embedder, "secret marker beta question please", tenant="globex"),
        ]
        return hits == ["semantic:a1", "semantic:b2"]

    await eventually(b_learned_both)
    assert any(b"secret marker" in value for value in await _everything_in(redis_server))
    await b.purge("globex")
    await asyncio.sleep(1.2)  # the TTL itself is what is under test
    values = await _everything_in(redis_server)
    assert [v for v in values if b"secret marker" in v or v.startswith((b"t=", b"v="))] == []
    await a.aclose()
    await b.aclose()
