"""Several gateway instances (independent limiters and connections) sharing one real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from gateway.limits.check import LimitExceeded
from gateway.limits.cost import Usage
from gateway.limits.gcra import Rate
from gateway.limits.limiter import Admission, Limiter
from gateway.limits.redis_store import RedisLimitStore
from gateway.limits.rules import BudgetRule, RateLimits, Subject
from gateway.limits.store import SPEND, AcquireRequest, BucketTake, SettleRequest, UsageAdd
from gateway.limits.usage import UsageRecord
from gateway.limits.windows import window_of
from tests.cache.conftest import RedisServer
from tests.gateway.limits.conftest import Clock, redis_store

pytestmark = pytest.mark.redis

Factory = Callable[..., Limiter]


@pytest.fixture
async def instances(redis_server: RedisServer) -> AsyncIterator[Factory]:
    made: list[Limiter] = []

    def make(fail_open: bool = True, lease_ttl_s: float = 30.0) -> Limiter:
        lim = Limiter(redis_store(redis_server), fail_open=fail_open, lease_ttl_s=lease_ttl_s)
        made.append(lim)
        return lim

    yield make
    for lim in made:
        try:
            async with asyncio.timeout(3):
                await lim.aclose()
        except TimeoutError:
            import sys

            for t in asyncio.all_tasks():
                print("TASK", t, file=sys.stderr)
                t.print_stack(file=sys.stderr)
            raise


async def burst(limiters: list[Limiter], subject: Subject, count: int, tokens: int = 1) -> int:
    """``count`` concurrent admissions spread round-robin over ``limiters``; how many passed."""

    async def one(i: int) -> bool:
        try:
            await limiters[i % len(limiters)].admit(subject, tokens)
        except LimitExceeded:
            return False
        return True

    return sum(await asyncio.gather(*(one(i) for i in range(count))))


async def test_three_instances_admit_exactly_the_limit(instances: Factory) -> None:
    gateways = [instances() for _ in range(3)]
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=20))
    assert await burst(gateways, subject, 60) == 20


async def test_a_long_burst_admits_the_limit_plus_the_refill(instances: Factory) -> None:
    """GCRA's bound on Redis's clock: limit + elapsed x rate, whatever the instance count."""
    gateways = [instances() for _ in range(4)]
    wide = Subject("team-b", "chat", RateLimits(requests_per_minute=500))
    started = time.monotonic()
    admitted = await burst(gateways, wide, 2_000)
    elapsed_ms = (time.monotonic() - started) * 1000
    assert 500 <= admitted <= 500 + int(elapsed_ms * 500 / 60_000) + 1


async def test_a_burst_at_one_instant_admits_exactly_the_limit(
    redis_server: RedisServer,
) -> None:
    clock = Clock()  # every instance passes the same instant: no refill during the burst
    gateways = [Limiter(redis_store(redis_server), clock=clock) for _ in range(4)]
    wide = Subject("team-b", "chat", RateLimits(requests_per_minute=500))
    try:
        assert await burst(gateways, wide, 2_000) == 500
        clock.advance(0.12)  # one request's refill at 500 per minute
        assert await burst(gateways, wide, 40) == 1
    finally:
        for lim in gateways:
            await lim.aclose()


async def test_tokens_and_surface_limits_are_shared(instances: Factory) -> None:
    gateways = [instances() for _ in range(3)]
    subject = Subject("team-a", "chat", RateLimits(tokens_per_minute=10_000),
                      RateLimits(requests_per_minute=1_000))  # fmt: skip
    assert await burst(gateways, subject, 90, tokens=400) == 25  # 25 x 400 = 10,000
    other = Subject("team-a", "voice", None, RateLimits(requests_per_minute=7))
    assert await burst(gateways, other, 30) == 7


async def test_concurrency_is_shared_and_released(instances: Factory) -> None:
    gateways = [instances() for _ in range(3)]
    subject = Subject("team-a", "chat", RateLimits(max_concurrent=5))
    held: list[Admission] = []

    async def one(i: int) -> None:
        with contextlib.suppress(LimitExceeded):
            held.append(await gateways[i % 3].admit(subject, 1))

    await asyncio.gather(*(one(i) for i in range(30)))
    assert len(held) == 5
    for lim in gateways:
        for adm in held:
            if adm.lease_id.startswith(lim._lease_prefix):
                lim.finish(adm, None)
        await lim.drain()
    assert await burst(gateways, subject, 30) == 5


# Leases renewed every third of it: long enough that a loaded machine's pauses never let a
# renewed lease lapse, nor the crashed one lapse before the check that it still holds.
LEASE_TTL_S = 1.0


async def admitted_once_expired(lim: Limiter, subject: Subject, cost: int = 0) -> None:
    """Admitted as soon as what a crashed instance held has expired (a bounded wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10 * LEASE_TTL_S
    while True:
        try:
            await lim.admit(subject, 1, cost=cost)
            return
        except LimitExceeded:
            assert loop.time() < deadline, "what the crashed instance held never expired"
            await asyncio.sleep(0.05)


async def test_a_crashed_instance_leaks_no_slot(instances: Factory) -> None:
    crashed, alive = instances(lease_ttl_s=LEASE_TTL_S), instances(lease_ttl_s=LEASE_TTL_S)
    await alive.start()
    subject = Subject("team-a", "chat", RateLimits(max_concurrent=2))
    await crashed.admit(subject, 1)
    long_running = await alive.admit(subject, 1)
    await crashed.store.aclose()  # gone without releasing its lease
    with pytest.raises(LimitExceeded):
        await alive.admit(subject, 1)
    # past the TTL: the crashed lease expired, the renewed one did not
    await admitted_once_expired(alive, subject)
    with pytest.raises(LimitExceeded, match="2 requests in flight"):
        await alive.admit(subject, 1)
    alive.finish(long_running, None)


async def test_instances_in_a_burst_never_pass_the_budget(instances: Factory) -> None:
    """Three instances admit a burst together: each request holds its worst case (0.3 USD of
    1) in Redis, so only what the budget covers is admitted and the spend stays within it."""
    gateways = [instances() for _ in range(3)]
    rule = BudgetRule(Decimal("1"), "day")
    subject = Subject("team-a", "chat", None, None, rule)
    hold, cost = rule.cap * 3 // 10, rule.cap * 29 // 100

    async def one(i: int) -> tuple[Limiter, Admission] | None:
        lim = gateways[i % 3]
        try:
            return lim, await lim.admit(subject, 1, cost=hold)
        except LimitExceeded:
            return None

    admitted = [a for a in await asyncio.gather(*(one(i) for i in range(30))) if a is not None]
    assert len(admitted) == 3
    for lim, adm in admitted:
        lim.finish(adm, UsageRecord("chat", "m", Usage(10, 0, 10), cost))
    for lim in gateways:
        await lim.drain()
    fields = await gateways[0].record_of("team-a", window_of("day", gateways[0].now_s()))
    assert fields[SPEND] == 3 * cost <= rule.cap and fields.get("held$", 0) == 0


async def test_a_crashed_instance_leaks_no_hold(instances: Factory) -> None:
    crashed, alive = instances(lease_ttl_s=LEASE_TTL_S), instances(lease_ttl_s=LEASE_TTL_S)
    await alive.start()
    rule = BudgetRule(Decimal("1"), "day")
    subject = Subject("team-a", "chat", None, None, rule)
    await crashed.admit(subject, 1, cost=rule.cap // 2)
    long_running = await alive.admit(subject, 1, cost=rule.cap // 4)
    await crashed.store.aclose()  # gone without releasing its hold
    with pytest.raises(LimitExceeded, match=r"requests in flight hold 0\.75 USD"):
        await alive.admit(subject, 1, cost=rule.cap // 2)
    # past the TTL: the crashed hold expired, the renewed one did not
    await admitted_once_expired(alive, subject, cost=rule.cap // 2)
    with pytest.raises(LimitExceeded, match=r"requests in flight hold 0\.75 USD"):
        await alive.admit(subject, 1, cost=rule.cap // 4 + 1)
    alive.finish(long_running, None)


async def test_capacity_refills_on_the_servers_clock(redis_server: RedisServer) -> None:
    store = redis_store(redis_server)
    # 5 per 5 s on Redis TIME: one refills each second, so a loaded machine's six checks in a
    # row are still one instant (at 5 per 0.5 s a 100 ms pause refilled the sixth's)
    take = AcquireRequest((BucketTake("t:r", Rate(5, 5_000), 1),))
    try:
        results = [await store.acquire(take) for _ in range(6)]
        assert [r.admitted for r in results] == [True] * 5 + [False]
        wait_ms = results[-1].wait_ms or 0
        assert 0 < wait_ms <= 1_000
        await asyncio.sleep(wait_ms / 1000 + 0.01)  # the wait the refusal told
        assert (await store.acquire(take)).admitted
    finally:
        await store.aclose()


async def test_settlements_from_all_instances_add_up_exactly(instances: Factory) -> None:
    gateways = [instances() for _ in range(3)]
    rule = BudgetRule(Decimal("2"), "day", (Decimal("0.5"),))
    subject = Subject("team-a", "chat", None, None, rule)
    fired: list[str] = []
    for lim in gateways:
        lim.ledger.on_alert = lambda alert: fired.append(alert.tenant)
    record = UsageRecord("chat", "m", Usage(1_000, 200, 50), 12_345_678_901)
    for i in range(90):
        lim = gateways[i % 3]
        lim.finish(await lim.admit(subject, 1), record)
    for lim in gateways:
        await lim.drain()
    fields = await gateways[0].record_of("team-a", window_of("day", gateways[0].now_s()))
    assert fields["spend$"] == 90 * 12_345_678_901
    assert (fields["chat:n"], fields["chat:in"], fields["chat:cached"]) == (90, 90_000, 18_000)
    assert fired == ["team-a"]  # 0.5 USD crossed once, by whichever instance crossed it


async def test_redis_killed_mid_run_fails_open(
    instances: Factory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gateways = [instances(fail_open=True) for _ in range(3)]
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=1_000))
    in_flight = await gateways[0].admit(subject, 1)
    assert await burst(gateways, subject, 30) == 30
    redis_server.stop()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm_gateway.limits"):
        assert await burst(gateways, subject, 30) == 30  # admitted, without limits
        record = UsageRecord("chat", "m", Usage(10, 0, 10), 5_000_000)
        gateways[0].finish(in_flight, record)  # its settlement fails: usage is kept
        await gateways[0].drain()
    assert sum(g.unavailable for g in gateways) == 30
    degraded = [r.message for r in caplog.records if "admitting without limits" in r.message]
    assert len(degraded) == 3  # once per instance, not once per request
    assert sum(1 for r in caplog.records if "unavailable (" in r.message) == 3
    redis_server.start()  # empty, on the same port
    await asyncio.sleep(0.25)  # past the store's back-off
    await gateways[0].flush()
    fields = await gateways[0].record_of("team-a", window_of("month", gateways[0].now_s()))
    assert fields["spend$"] == 5_000_000  # the spend of the outage was not lost
    assert await burst(gateways, Subject("t2", "chat", RateLimits(requests_per_minute=3)), 9) == 3


async def test_redis_killed_mid_run_fails_closed(
    instances: Factory, redis_server: RedisServer
) -> None:
    gateway = instances(fail_open=False)
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=1_000))
    await gateway.admit(subject, 1)
    redis_server.stop()
    for _ in range(5):
        with pytest.raises(LimitExceeded) as refused:
            await gateway.admit(subject, 1)
        assert refused.value.reason == "unavailable" and "Retry-After" in refused.value.headers
    assert gateway.unavailable == 5
    assert isinstance(gateway.store, RedisLimitStore) and gateway.store.failures >= 1
    redis_server.start()
    await asyncio.sleep(0.25)
    await gateway.admit(subject, 1)


async def test_a_settlement_runs_once_whatever_is_resent(redis_server: RedisServer) -> None:
    store = redis_store(redis_server)
    add = UsageAdd("lgw:lim:{t}:u:x", 60, ((SPEND, 7),))
    req = SettleRequest(usage=(add,), id="s-1", done_key="lgw:lim:{t}:done:s-1")
    try:
        assert await store.settle(req) == (7,)
        assert await store.settle(req) is None  # sent again: not applied again
        assert (await store.read_usage(add.key))[SPEND] == 7
        admin = aioredis.Redis.from_url(redis_server.url)
        # one key per settled request: kept an hour (a day held 8.6 M keys at 100 req/s)
        assert 3500 < await admin.ttl("lgw:lim:{t}:done:s-1") <= 3600
        await admin.aclose()
    finally:
        await store.aclose()


async def test_a_lost_answer_is_written_exactly_once(redis_server: RedisServer) -> None:
    store = RedisLimitStore(redis_server.url, timeout_s=0.1, retry_after_s=0.05)
    lim = Limiter(store)
    admin = aioredis.Redis.from_url(redis_server.url)
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=100))
    record = UsageRecord("chat", "m", Usage(10, 0, 5), 1_234)
    try:
        adm = await lim.admit(subject, 1)  # also opens the connection the settlement will use
        # the server holds every client's commands: long enough that a loaded machine's
        # settlement is still written inside the pause
        await admin.client_pause(1_500, all=True)
        lim.finish(adm, record)
        await lim.drain()
        assert lim.ledger.uncertain == 1  # sent, no answer in time: it may have run
        await admin.ping()  # answered once the pause is over
        await asyncio.sleep(0.1)  # and the store's back-off (0.05 s) from the time-out
        await lim.flush()
        assert not lim.ledger.waiting
        fields = await lim.record_of("team-a", window_of("week", lim.now_s()))
        assert (fields[SPEND], fields["chat:n"]) == (1_234, 1)
    finally:
        await admin.aclose()
        await lim.aclose()
