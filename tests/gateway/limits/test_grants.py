"""Grants on a real Redis: requests admitted in memory from units taken ahead, never more than
the limit across instances, everything unused given back (``gateway.limits.grants``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from gateway.limits.check import LimitExceeded
from gateway.limits.cost import Usage
from gateway.limits.gcra import Rate
from gateway.limits.grants import HEADROOM
from gateway.limits.limiter import Admission, Limiter
from gateway.limits.rules import BudgetRule, Keys, RateLimits, Subject
from gateway.limits.store import AcquireRequest, BucketTake
from gateway.limits.usage import UsageRecord
from tests.cache.conftest import RedisServer
from tests.gateway.limits.conftest import Clock, redis_store
from tests.gateway.limits.test_shared import burst

pytestmark = pytest.mark.redis

Factory = Callable[..., Limiter]
WIDE = RateLimits(requests_per_minute=100_000, tokens_per_minute=10_000_000, max_concurrent=10_000)
SCOPE = Keys().scope("team-a")


@pytest.fixture
async def limiters(redis_server: RedisServer, clock: Clock) -> AsyncIterator[Factory]:
    """Limiters with grants of 16 on one Redis; all on ``clock`` (no refill unless moved)."""
    made: list[Limiter] = []

    def make(grant_ttl_s: float = 30.0) -> Limiter:
        lim = Limiter(
            redis_store(redis_server), clock=clock, grant_requests=16, grant_ttl_s=grant_ttl_s,
            lease_ttl_s=120.0,
        )  # fmt: skip
        made.append(lim)
        return lim

    yield make
    for lim in made:
        await lim.aclose()


@pytest.fixture
async def peek(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def settled(lim: Limiter) -> None:
    """The settlements in flight have reached Redis (the grants stay: not ``drain``)."""
    while lim._tasks:
        await asyncio.gather(*list(lim._tasks))


async def debt_units(peek: aioredis.Redis, key: str) -> int:
    """A bucket's debt in units (requests or tokens) taken per minute."""
    raw = await peek.hget(key, "d")
    return int(raw or 0) // 60_000


async def used_before(lim: Limiter, limits: RateLimits, units: int) -> None:
    """``units`` of team-a's ``requests_per_minute`` taken before the test, in one check.

    Why the tests of exact counts start with much of a larger limit used: the clock stands
    still, so nothing refills, but Redis expires a bucket's key on its own clock, once its debt
    would have drained in real time, plus a second (``gateway.limits.lua``; in production the
    clock is Redis's and the two agree). At 3,000 a minute the 54 requests taken before the
    burst below are 1.08 s of drain: a loaded machine whose loop stalled 2.1 s before the
    burst's first check found the key gone and admitted them again (3,045 of 2,991; a 1.2 s
    stall after the first checks of the steady test: 3,003 of 3,000). 3,000 of 6,000 used
    keeps the key 31 s past any check, 2,000 of 2,127 56 s: longer than any stall."""
    assert limits.requests_per_minute is not None
    take = BucketTake(SCOPE + ":r", Rate(limits.requests_per_minute), units)
    req = AcquireRequest((take,), now_ms=lim._now_ms())
    assert (await lim.store.acquire(req)).admitted


async def test_a_grant_admits_the_next_requests_in_memory_and_gives_back_the_rest(
    limiters: Factory, peek: aioredis.Redis
) -> None:
    lim = limiters()
    subject = Subject("team-a", "chat", WIDE)
    held: list[Admission] = [await lim.admit(subject, 100)]  # asks Redis; far from the limit
    assert lim.granted == 0 and not lim._grants
    held.append(await lim.admit(subject, 100))  # asks Redis, for itself and 16 more
    assert await debt_units(peek, SCOPE + ":r") == 1 + 1 + 16
    assert await peek.zcard(SCOPE + ":c") == 1 + 1 + 16
    for _ in range(16):
        held.append(await lim.admit(subject, 100))  # from the grant: Redis is not asked
    assert lim.granted == 16
    assert await debt_units(peek, SCOPE + ":r") == 18  # unchanged: taken ahead
    # Each admission's headers are what a check per request would have said (no refill: the
    # clock stands still); the reset counts the requests used, not the grant's units.
    views = [a.requests for a in held]
    assert [v.remaining for v in views if v] == [100_000 - 1 - i for i in range(18)]
    assert [v.reset_ms for v in views if v] == [math.ceil((i + 1) * 0.6) for i in range(18)]
    assert len({a.lease_id for a in held}) == 18  # every request holds a lease of its own
    held.append(await lim.admit(subject, 100))  # the grant is spent: another one
    assert await debt_units(peek, SCOPE + ":r") == 19 + 16
    assert await debt_units(peek, SCOPE + ":k") == (19 + 16) * 100
    await lim.drain()  # gives the unused grant back
    assert await debt_units(peek, SCOPE + ":r") == 19
    assert await debt_units(peek, SCOPE + ":k") == 19 * 100
    assert await peek.zcard(SCOPE + ":c") == 19  # the requests still in flight
    for adm in held:  # each used 30 tokens of its 100
        lim.finish(adm, UsageRecord("chat", "m", Usage(20, 0, 10), 1))
    await lim.drain()
    assert await debt_units(peek, SCOPE + ":k") == 19 * 30
    assert await peek.zcard(SCOPE + ":c") == 0


async def test_a_grant_is_given_back_when_its_time_is_up(
    limiters: Factory, peek: aioredis.Redis
) -> None:
    lim = limiters(grant_ttl_s=0.05)
    subject = Subject("team-a", "chat", WIDE)
    first = await lim.admit(subject, 10)
    second = await lim.admit(subject, 10)  # takes a grant of 16
    assert await peek.zcard(SCOPE + ":c") == 18
    # Its time is up at 0.05 s: the grant goes, then its give-back reaches Redis (waited for
    # here, bounded, not a fixed sleep a loaded machine can outlast).
    deadline = asyncio.get_running_loop().time() + 5
    while lim._grants:
        assert asyncio.get_running_loop().time() < deadline, "the grant was never given back"
        await asyncio.sleep(0.01)
    await settled(lim)
    assert await debt_units(peek, SCOPE + ":r") == 2
    assert await debt_units(peek, SCOPE + ":k") == 20
    assert await peek.zcard(SCOPE + ":c") == 2
    third = await lim.admit(subject, 10)  # an expired grant admits nothing: Redis is asked
    assert lim.granted == 0 and await debt_units(peek, SCOPE + ":r") == 3 + 16
    for adm in (first, second, third):
        lim.finish(adm, None)


async def test_a_request_larger_than_the_grant_asks_redis(limiters: Factory) -> None:
    lim = limiters()
    subject = Subject("team-a", "chat", WIDE)
    await lim.admit(subject, 100)
    await lim.admit(subject, 100)  # a grant sized for 100-token requests: 1,600 tokens
    await lim.admit(subject, 1_550)  # fits the grant's tokens
    assert lim.granted == 1
    await lim.admit(subject, 100)  # 50 tokens left in it: asks Redis (and takes a new grant)
    assert lim.granted == 1


async def test_near_a_limit_every_request_asks_redis(limiters: Factory) -> None:
    """Grants need HEADROOM x the grant left: a tight limit is checked request by request,
    and a burst across instances admits exactly the limit, as without grants."""
    gateways = [limiters() for _ in range(3)]
    limit = 2 * HEADROOM - 1  # room for a grant of one: none is taken
    limits = RateLimits(requests_per_minute=2_000 + limit)
    await used_before(gateways[0], limits, 2_000)  # ``used_before``: why
    subject = Subject("team-a", "chat", limits)
    for i in range(30):
        await gateways[i % 3].admit(subject, 1)
    assert sum(g.granted for g in gateways) == 0

    assert await burst(gateways, subject, 3 * limit) == limit - 30


async def test_instances_with_grants_admit_exactly_the_limit(limiters: Factory) -> None:
    """Three instances, each asking steadily until well past the limit: together they admit
    exactly the limit (the clock stands still: nothing refills), most of it from grants."""
    gateways = [limiters() for _ in range(3)]
    limit = 3_000  # left of 6,000, half used before (``used_before``: why)
    limits = RateLimits(requests_per_minute=2 * limit, max_concurrent=10**6)
    await used_before(gateways[0], limits, limit)
    subject = Subject("team-a", "chat", limits)
    admitted = [0, 0, 0]

    async def steady(n: int) -> None:
        for _ in range(1_500):
            try:
                await gateways[n].admit(subject, 1)
            except LimitExceeded:
                continue
            admitted[n] += 1

    await asyncio.gather(*(steady(n) for n in range(3)))
    assert sum(admitted) == limit
    assert all(a > 0 for a in admitted)
    assert sum(g.granted for g in gateways) > limit // 2


async def test_a_burst_after_steady_traffic_admits_exactly_the_limit(limiters: Factory) -> None:
    """Instances holding grants (and about to take more) when a burst far past the limit
    arrives: the burst's requests use the grants or wait for the one on its way, so none is
    left unused while another instance refuses: exactly the limit, as without grants."""
    gateways = [limiters() for _ in range(3)]
    limit = 3_000  # left of 6,000, half used before (``used_before``: why)
    limits = RateLimits(requests_per_minute=2 * limit)
    await used_before(gateways[0], limits, limit)
    subject = Subject("team-a", "chat", limits)
    for _ in range(3):
        for lim in gateways:
            await lim.admit(subject, 1)  # the second check of each instance takes a grant
    assert all(lim._grants for lim in gateways)

    assert await burst(gateways, subject, 3 * limit) == limit - 9
    assert sum(lim.granted for lim in gateways) > 3 * 16


async def test_a_budget_of_a_few_requests_is_refused_exactly(limiters: Factory) -> None:
    """A budget takes no grant, so the request after the spend passed it is refused."""
    lim = limiters()
    budget = BudgetRule(Decimal("1"))
    subject = Subject("team-a", "chat", None, None, budget)
    answer = UsageRecord("chat", "m", Usage(10, 0, 10), budget.cap * 3 // 10)  # 0.30 USD
    for _ in range(4):  # 0.00, 0.30, 0.60, 0.90 USD spent when admitted
        lim.finish(await lim.admit(subject, 10), answer)
        await settled(lim)
    with pytest.raises(LimitExceeded) as refused:
        await lim.admit(subject, 10)
    assert refused.value.reason == "budget"
    assert lim.granted == 0


async def test_a_budgeted_subject_takes_no_grant(limiters: Factory) -> None:
    """However large its budget: each request holds its own cost in Redis, so each asks."""
    lim = limiters()
    subject = Subject("team-a", "chat", WIDE, None, BudgetRule(Decimal("1000")))
    answer = UsageRecord("chat", "m", Usage(10, 0, 10), 17_000_000_000)  # 0.017 USD
    for _ in range(6):
        lim.finish(await lim.admit(subject, 10, cost=20_000_000_000), answer)
        await settled(lim)
    assert lim.granted == 0 and not lim._grants
