"""The stored-response store, in memory and in a real Redis: scoping, TTL and bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.conversations import (
    RecordTooLarge,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    StoreUnavailable,
    open_store,
    tenant_key,
)
from gateway.conversations.redis_store import RedisResponseStore
from tests.cache.conftest import RedisServer


def record(tenant: str, n: int, text: str = "hi") -> StoredResponse:
    return StoredResponse(
        response={"id": f"resp_{n}", "object": "response", "output": [{"text": text}]},
        input_items=[{"id": f"msg_{n}", "type": "message", "role": "user", "content": []}],
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
        tenant=tenant,
    )


@pytest.fixture(params=["memory", "redis"])
async def make_store(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Any]:
    stores: list[ResponseStore] = []
    server: RedisServer | None = None
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")

    def make(limits: StoreLimits | None = None) -> ResponseStore:
        store = open_store(server.url if server is not None else None, limits)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


async def test_a_record_round_trips_for_its_tenant_only(make_store: Any) -> None:
    store = make_store()
    await store.put(record("team-a", 1, "secret of a"))
    got = await store.get("team-a", "resp_1")
    assert got is not None
    assert got.response["output"] == [{"text": "secret of a"}]
    assert got.messages[0] == {"role": "user", "content": "secret of a"}
    assert got.input_items[0]["id"] == "msg_1"
    assert await store.get("team-b", "resp_1") is None  # another tenant: as if unknown
    assert await store.delete("team-b", "resp_1") is False
    assert await store.get("team-a", "resp_1") is not None  # b's delete did nothing
    assert await store.get("team-a", "resp_404") is None


async def test_same_id_under_two_tenants_stays_apart(make_store: Any) -> None:
    store = make_store()
    await store.put(record("team-a", 7, "a's"))
    await store.put(record("team-b", 7, "b's"))
    a, b = await store.get("team-a", "resp_7"), await store.get("team-b", "resp_7")
    assert a is not None and b is not None
    assert (a.messages[0]["content"], b.messages[0]["content"]) == ("a's", "b's")


async def test_delete(make_store: Any) -> None:
    store = make_store()
    await store.put(record("t", 1))
    assert await store.delete("t", "resp_1") is True
    assert await store.get("t", "resp_1") is None
    assert await store.delete("t", "resp_1") is False


async def test_records_expire(make_store: Any) -> None:
    store = make_store(StoreLimits(ttl_s=1))
    await store.put(record("t", 1))
    assert await store.get("t", "resp_1") is not None
    await asyncio.sleep(1.2)
    assert await store.get("t", "resp_1") is None


async def test_a_record_over_the_size_bound_is_refused(make_store: Any) -> None:
    store = make_store(StoreLimits(max_record_bytes=2000))
    with pytest.raises(RecordTooLarge):
        await store.put(record("t", 1, "x" * 3000))
    assert await store.get("t", "resp_1") is None
    await store.put(record("t", 2, "small"))
    assert await store.get("t", "resp_2") is not None


async def test_each_tenant_keeps_at_most_max_entries(make_store: Any) -> None:
    store = make_store(StoreLimits(max_entries=3))
    for n in range(5):
        await store.put(record("busy", n))
    await store.put(record("quiet", 0))
    kept = [n for n in range(5) if await store.get("busy", f"resp_{n}") is not None]
    assert kept == [2, 3, 4]  # the oldest went first
    assert await store.get("quiet", "resp_0") is not None  # another tenant's are untouched


async def test_the_oldest_go_first_however_fast_they_come(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock that never moves: every record is written in the same instant (in Redis they
    # were equal scores, removed in id order: resp_0, resp_1, resp_10, resp_11 before resp_2).
    frozen = time.time()
    monkeypatch.setattr("time.time", lambda: frozen)
    store = make_store(StoreLimits(max_entries=3))
    for n in range(12):
        await store.put(record("busy", n))
        assert await store.get("busy", f"resp_{n}") is not None  # the newest always stays
    kept = [n for n in range(12) if await store.get("busy", f"resp_{n}") is not None]
    assert kept == [9, 10, 11]


async def test_a_lowered_ttl_keeps_the_newest_responses(redis_server: RedisServer) -> None:
    """A reload that lowers ``ttl_s`` (or two instances with different ones): new records
    expire sooner than the old ones, yet they are the newest, and the oldest go first."""
    month, hour = StoreLimits(ttl_s=30 * 24 * 3600, max_entries=3), StoreLimits(3600, max_entries=3)
    before, after = open_store(redis_server.url, month), open_store(redis_server.url, hour)
    try:
        for n in range(3):
            await before.put(record("t", n))
        for n in range(3, 6):
            await after.put(record("t", n))
            assert await after.get("t", f"resp_{n}") is not None
        assert [n for n in range(6) if await after.get("t", f"resp_{n}") is not None] == [3, 4, 5]
    finally:
        await before.aclose()
        await after.aclose()


async def test_an_expired_record_stops_counting_toward_max_entries(
    redis_server: RedisServer,
) -> None:
    lasting, brief = StoreLimits(3600, max_entries=3), StoreLimits(1, max_entries=3)
    one, two = open_store(redis_server.url, lasting), open_store(redis_server.url, brief)
    try:
        await one.put(record("t", 0))
        await one.put(record("t", 1))
        await two.put(record("t", 2))  # newer than 0 and 1, but gone first
        await asyncio.sleep(1.5)
        await one.put(record("t", 3))
        assert [n for n in range(4) if await one.get("t", f"resp_{n}") is not None] == [0, 1, 3]
    finally:
        await one.aclose()
        await two.aclose()


async def test_nothing_of_a_tenant_outlives_its_records(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url, StoreLimits(ttl_s=1))
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.put(record("t", 1))
        await store.put(record("t", 2))
        assert await raw.dbsize() > 2  # the records and the tenant's index
        await asyncio.sleep(1.5)
        assert await raw.dbsize() == 0
    finally:
        await store.aclose()
        await raw.aclose()


async def test_records_of_the_earlier_index_count_as_the_oldest(
    redis_server: RedisServer,
) -> None:
    """Records written by a version whose index was one sorted set by expiry (``:z``) are
    folded into the new index on the tenant's next write, as its oldest records."""
    store = open_store(redis_server.url, StoreLimits(ttl_s=3600, max_entries=3))
    assert isinstance(store, RedisResponseStore)
    raw = aioredis.Redis.from_url(redis_server.url)
    base = f"{store.prefix}:{tenant_key('t')}"
    now = int(time.time())
    try:
        for n in range(3):  # written by the old version with a 30-day TTL, n=0 first
            await raw.set(f"{base}:r:resp_{n}", record("t", n).encode(), ex=30 * 24 * 3600)
            await raw.zadd(f"{base}:z", {f"resp_{n}": now + 30 * 24 * 3600 + n})
        await raw.set(f"{base}:r:resp_9", record("t", 9).encode(), ex=30 * 24 * 3600)
        await raw.zadd(f"{base}:z", {"resp_9": now - 5})  # expired, its record not yet
        await store.put(record("t", 3))
        assert await raw.exists(f"{base}:z") == 0
        assert [n for n in range(4) if await store.get("t", f"resp_{n}") is not None] == [1, 2, 3]
    finally:
        await store.aclose()
        await raw.aclose()


async def test_the_memory_store_is_bounded_in_bytes() -> None:
    size = len(record("t0", 0, "y" * 500).encode())
    store = open_store(None, StoreLimits(max_record_bytes=size, max_total_bytes=2 * size + 10))
    for n in range(5):
        await store.put(record(f"t{n}", n, "y" * 500))
    kept = [n for n in range(5) if await store.get(f"t{n}", f"resp_{n}") is not None]
    assert kept == [3, 4]
    await store.aclose()


async def test_a_tenant_over_the_byte_bound_pushes_out_its_own_records_first() -> None:
    size = len(record("busy", 0, "y" * 500).encode())
    store = open_store(None, StoreLimits(max_total_bytes=4 * size + 10))
    await store.put(record("quiet", 0, "y" * 500))
    for n in range(8):
        await store.put(record("busy", n, "y" * 500))
    assert await store.get("quiet", "resp_0") is not None  # it holds less: never pushed out
    kept = [n for n in range(8) if await store.get("busy", f"resp_{n}") is not None]
    assert kept == [5, 6, 7]
    # The quiet tenant still finds room: the busiest tenant gives it up.
    await store.put(record("quiet", 1, "y" * 500))
    assert await store.get("quiet", "resp_0") is not None
    assert await store.get("quiet", "resp_1") is not None
    assert [n for n in range(8) if await store.get("busy", f"resp_{n}") is not None] == [6, 7]
    with pytest.raises(RecordTooLarge):  # larger than the whole bound: never stored
        await store.put(record("quiet", 2, "y" * 5 * size))
    await store.aclose()


async def test_redis_down_is_store_unavailable(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url)
    await store.put(record("t", 1))
    redis_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            await store.get("t", "resp_1")
        with pytest.raises(StoreUnavailable):
            await store.put(record("t", 2))
    finally:
        await store.aclose()


async def test_two_stores_on_one_redis_share_records(redis_server: RedisServer) -> None:
    one, two = open_store(redis_server.url), open_store(redis_server.url)
    try:
        await one.put(record("t", 1, "from one"))
        got = await two.get("t", "resp_1")
        assert got is not None and got.messages[0]["content"] == "from one"
        assert await two.delete("t", "resp_1") is True
        assert await one.get("t", "resp_1") is None
    finally:
        await one.aclose()
        await two.aclose()
