"""The limiter on both stores: refusals and headers, reconciliation, budgets, alerts, windows."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from decimal import Decimal

import pytest

from gateway.limits.check import LimitExceeded
from gateway.limits.cost import Usage
from gateway.limits.limiter import Admission, Limiter
from gateway.limits.rules import BudgetRule, RateLimits, Subject
from gateway.limits.store import LimitStore
from gateway.limits.usage import BudgetAlert, UsageRecord, report
from gateway.limits.windows import window_of
from tests.gateway.limits.conftest import Clock

TENANT = RateLimits(requests_per_minute=3, tokens_per_minute=1_000, max_concurrent=2)
CHAT = RateLimits(requests_per_minute=2)


@pytest.fixture
async def limiter(store: LimitStore, clock: Clock) -> AsyncIterator[Limiter]:
    lim = Limiter(store, clock=clock)
    yield lim
    await lim.drain()


def who(surface: str = "chat", budget: BudgetRule | None = None, **kw: RateLimits) -> Subject:
    return Subject(
        "team-a",
        surface,
        kw.get("limits", TENANT),
        kw.get("surface_limits", CHAT if surface == "chat" else None),
        budget,
    )


def used(tokens: int, cost: int = 0, surface: str = "chat", hit: bool = False) -> UsageRecord:
    return UsageRecord(surface, "m", Usage(input=tokens, output=0), cost, cache_hit=hit)


async def done(lim: Limiter, adm: Admission, record: UsageRecord | None) -> None:
    lim.finish(adm, record)
    await lim.drain()


async def test_unlimited_tenants_get_no_headers(limiter: Limiter) -> None:
    adm = await limiter.admit(Subject("free", "chat"), tokens=10**9)
    assert adm.headers() == {} and not adm.degraded


async def test_requests_refused_as_openai_does(limiter: Limiter) -> None:
    first = await limiter.admit(who("batch"), 10)
    assert first.headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "20s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "990",
        "x-ratelimit-reset-tokens": "600ms",
    }
    await done(limiter, first, used(10))
    for _ in range(2):
        await done(limiter, await limiter.admit(who("batch"), 10), used(10))
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(who("batch"), 10)
    assert refused.value.reason == "requests"
    assert "limit 3 requests per minute" in refused.value.message
    headers = refused.value.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert (headers["Retry-After"], headers["retry-after-ms"]) == ("20", "20000")


async def test_the_surface_limit_binds_per_tenant_on_that_surface(limiter: Limiter) -> None:
    a = await limiter.admit(who("chat"), 1)
    b = await limiter.admit(who("chat"), 1)
    assert b.headers()["x-ratelimit-limit-requests"] == "2"  # the tighter limit shows
    assert b.headers()["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(LimitExceeded, match="on surface 'chat'") as refused:
        await limiter.admit(who("chat"), 1)
    assert refused.value.reason == "requests"
    for adm in (a, b):
        await done(limiter, adm, used(1))
    # The tenant's own limit (3) still has one request for another surface.
    other = await limiter.admit(who("batch"), 1)
    assert other.headers()["x-ratelimit-remaining-requests"] == "0"


async def test_tokens_reserved_then_reconciled_to_real_usage(limiter: Limiter) -> None:
    big = await limiter.admit(who("batch"), 900)
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(who("batch"), 200)
    assert refused.value.reason == "tokens"
    assert refused.value.headers["retry-after-ms"] == "6000"  # 100 tokens at 60 ms each
    await done(limiter, big, used(150))  # it used 150 of the 900 reserved
    after = await limiter.admit(who("batch"), 800)
    assert after.headers()["x-ratelimit-remaining-tokens"] == "50"


async def test_a_failed_request_gives_its_tokens_back(limiter: Limiter) -> None:
    adm = await limiter.admit(who("batch"), 1_000)
    await done(limiter, adm, None)
    again = await limiter.admit(who("batch"), 1_000)
    assert again.headers()["x-ratelimit-remaining-tokens"] == "0"


async def test_usage_beyond_the_estimate_is_owed(limiter: Limiter, clock: Clock) -> None:
    adm = await limiter.admit(who("batch"), 100)
    await done(limiter, adm, used(1_300))  # 300 over the limit
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(who("batch"), 1)
    assert refused.value.headers["retry-after-ms"] == str(301 * 60)
    clock.advance(18.06)
    assert (await limiter.admit(who("batch"), 1)).tokens is not None


async def test_a_request_larger_than_the_token_limit_can_never_pass(limiter: Limiter) -> None:
    with pytest.raises(LimitExceeded, match="request too large: 1001 tokens") as refused:
        await limiter.admit(who("batch"), 1_001)
    assert refused.value.reason == "tokens" and "Retry-After" not in refused.value.headers


async def test_max_concurrent(limiter: Limiter, clock: Clock) -> None:
    a = await limiter.admit(who("batch"), 1)
    await limiter.admit(who("batch"), 1)
    with pytest.raises(LimitExceeded, match="2 requests in flight") as refused:
        await limiter.admit(who("batch"), 1)
    assert refused.value.reason == "concurrency"
    await done(limiter, a, used(1))
    clock.advance(20)  # the requests per minute come back too
    assert await limiter.admit(who("batch"), 1)


async def test_rate_windows_reset(limiter: Limiter, clock: Clock) -> None:
    for _ in range(2):
        await done(limiter, await limiter.admit(who("chat"), 1), used(1))
    with pytest.raises(LimitExceeded):
        await limiter.admit(who("chat"), 1)
    clock.advance(29.999)
    with pytest.raises(LimitExceeded):
        await limiter.admit(who("chat"), 1)
    clock.advance(0.001)  # 2 per minute: one back every 30 s
    await limiter.admit(who("chat"), 1)
    clock.advance(60)
    full = await limiter.admit(who("chat"), 1)
    assert full.headers()["x-ratelimit-remaining-requests"] == "1"


BUDGET = BudgetRule(Decimal("0.001"), "month", (Decimal("0.5"), Decimal("0.8")), "reject")
PICO = 10**12


async def test_spent_budget_refuses_until_the_window_renews(limiter: Limiter, clock: Clock) -> None:
    subject = who("batch", BUDGET, limits=RateLimits())
    adm = await limiter.admit(subject, 1)
    assert adm.spend == 0 and not adm.downgrade
    await done(limiter, adm, used(1, cost=PICO // 1000))  # exactly the budget
    with pytest.raises(LimitExceeded, match=r"monthly budget of 0\.001 USD") as refused:
        await limiter.admit(subject, 1)
    assert refused.value.reason == "budget"
    month_end = window_of("month", clock()).end.timestamp()
    assert refused.value.headers["Retry-After"] == str(math.ceil(month_end - clock()))
    clock.t = month_end
    renewed = await limiter.admit(subject, 1)
    assert renewed.spend == 0


async def test_downgrade_admits_and_says_so(limiter: Limiter) -> None:
    rule = BudgetRule(Decimal("0.001"), "day", (), "downgrade")
    subject = who("batch", rule, limits=RateLimits())
    await done(limiter, await limiter.admit(subject, 1), used(1, cost=PICO))
    adm = await limiter.admit(subject, 1)
    assert adm.downgrade and adm.spend == PICO


async def test_each_alert_fires_once_per_window(store: LimitStore, clock: Clock) -> None:
    fired: list[BudgetAlert] = []
    lim = Limiter(store, clock=clock, on_alert=fired.append)
    subject = who("batch", BUDGET, limits=RateLimits())
    step = PICO // 1000 // 20  # a twentieth of the budget
    for _ in range(18):
        lim.finish(await lim.admit(subject, 1), used(1, cost=step))
    await lim.drain()
    assert [(a.fraction, a.spend) for a in fired] == [
        (Decimal("0.5"), 10 * step),
        (Decimal("0.8"), 16 * step),
    ]
    clock.t = window_of("month", clock()).end.timestamp()
    await done(lim, await lim.admit(subject, 1), used(1, cost=18 * step))
    assert [a.window.id for a in fired][-2:] == ["m2026-12", "m2026-12"]
    assert lim.ledger.alerts_fired == 4


async def test_usage_report_per_surface(limiter: Limiter, clock: Clock) -> None:
    subject = who("batch", BUDGET, limits=RateLimits())
    for cost, hit in ((300_000_000, False), (100_000_000, False), (0, True)):
        adm = await limiter.admit(subject, 1)
        rec = UsageRecord("batch", "m", Usage(10, 4, 5) if not hit else Usage(), cost, hit)
        await done(limiter, adm, rec)
    month = window_of("month", clock())
    out = report("team-a", month, await limiter.record_of("team-a", month), BUDGET, ["batch"])
    assert (out["spend_usd"], out["budget_usd"], out["remaining_usd"]) == (
        "0.0004", "0.001", "0.0006")  # fmt: skip
    assert out["requests"] == 3 and out["cache_hits"] == 1
    assert out["tokens"] == {"input": 20, "cached_input": 8, "output": 10}
    row = out["surfaces"]["batch"]
    assert row["cost_per_1k_requests_usd"] == "0.133333333333"  # 0.0004 x 1000 / 3, floored
    day = window_of("day", clock())
    assert (await limiter.record_of("team-a", day))["spend$"] == 400_000_000


async def test_unlimited_usage_is_merged_and_lands_in_the_windows_it_was_spent_in(
    limiter: Limiter, clock: Clock
) -> None:
    """A tenant without limits or budget is not written per request: its usage is merged in
    memory and flushed, each request still counted in the day, week and month it ran in."""
    free = Subject("free", "chat")
    clock.t = math.floor(clock.t / 86_400) * 86_400 + 86_400 - 5  # 5 s before midnight UTC
    before = window_of("day", clock.t)
    for _ in range(3):
        limiter.finish(await limiter.admit(free, 10), used(100, cost=7))
    clock.advance(10)  # the next day (the same week and month here)
    after = window_of("day", clock.t)
    for surface in ("chat", "batch"):
        limiter.finish(await limiter.admit(free, 10), used(40, cost=5, surface=surface))
    await limiter.drain()
    day1 = await limiter.record_of("free", before)
    day2 = await limiter.record_of("free", after)
    assert (day1["spend$"], day1["chat:n"], day1["chat:in"]) == (21, 3, 300)
    assert (day2["spend$"], day2["chat:n"], day2["batch:n"], day2["batch:in"]) == (10, 1, 1, 40)
    month = await limiter.record_of("free", window_of("month", clock.t))
    assert (month["spend$"], month["chat:n"], month["chat:cost$"]) == (31, 4, 26)


# ---- holds: a budgeted request holds its worst-case cost until it settles ------------------

HOLD = 300_000_000  # 0.0003 USD: what each request may cost at most
COST = 250_000_000  # what its answer really costs


async def held(lim: Limiter, rule: BudgetRule = BUDGET) -> int:
    return (await lim.record_of("team-a", window_of(rule.window, lim.now_s()))).get("held$", 0)


async def test_a_concurrent_burst_never_passes_the_budget(limiter: Limiter) -> None:
    """Admitted together, before any answer settles: only what the budget covers (3 x 0.0003
    of 0.001 USD), so the settled spend stays within it."""
    subject = who("batch", BUDGET, limits=RateLimits())

    async def one() -> Admission | LimitExceeded:
        try:
            return await limiter.admit(subject, 1, cost=HOLD)
        except LimitExceeded as exc:
            return exc

    answers = await asyncio.gather(*(one() for _ in range(20)))
    admitted = [a for a in answers if isinstance(a, Admission)]
    assert len(admitted) == 3 and await held(limiter) == 3 * HOLD
    assert {a.reason for a in answers if isinstance(a, LimitExceeded)} == {"budget"}
    for adm in admitted:
        limiter.finish(adm, used(1, cost=COST))
    await limiter.drain()
    month = await limiter.record_of("team-a", window_of("month", limiter.now_s()))
    assert month["spend$"] == 3 * COST <= BUDGET.cap and month.get("held$", 0) == 0
    with pytest.raises(LimitExceeded, match=r"0\.00025 USD left of its monthly budget"):
        await limiter.admit(subject, 1, cost=HOLD)  # 0.00025 left cannot cover 0.0003


async def test_holds_are_released_whatever_the_end(limiter: Limiter) -> None:
    """An answer, a failure (no usage), a client gone (charged its estimate): held back to 0."""
    subject = who("batch", BUDGET, limits=RateLimits())
    for record in (used(1, cost=COST), None, used(1, cost=0)):
        adm = await limiter.admit(subject, 1, cost=HOLD)
        assert adm.hold is not None and await held(limiter) == HOLD
        await done(limiter, adm, record)
        assert await held(limiter) == 0


async def test_requests_in_flight_hold_the_budget_until_they_settle(limiter: Limiter) -> None:
    subject = who("batch", BUDGET, limits=RateLimits())
    first = await limiter.admit(subject, 1, cost=BUDGET.cap * 7 // 10)
    with pytest.raises(LimitExceeded, match=r"requests in flight hold 0\.0007 USD") as refused:
        await limiter.admit(subject, 1, cost=BUDGET.cap * 4 // 10)
    assert refused.value.headers["Retry-After"] == "1"  # they may settle for less
    await done(limiter, first, used(1, cost=BUDGET.cap // 10))
    await limiter.admit(subject, 1, cost=BUDGET.cap * 4 // 10)  # 0.0001 spent, 0.0004 held


async def test_a_request_costlier_than_the_whole_budget_is_refused_at_once(
    limiter: Limiter,
) -> None:
    subject = who("batch", BUDGET, limits=RateLimits())
    with pytest.raises(LimitExceeded, match="too costly") as refused:
        await limiter.admit(subject, 1, cost=BUDGET.cap + 1)
    assert refused.value.reason == "budget" and "Retry-After" not in refused.value.headers
    assert "may cost up to 0.001001 USD" in refused.value.message  # rounded up to a micro-dollar


async def test_a_downgrade_holds_nothing(limiter: Limiter) -> None:
    rule = BudgetRule(Decimal("0.001"), "day", (), "downgrade")
    subject = who("batch", rule, limits=RateLimits())
    kept = await limiter.admit(subject, 1, cost=HOLD * 3)
    adm = await limiter.admit(subject, 1, cost=HOLD)  # 0.0001 left: served cheaper, unheld
    assert (kept.downgrade, adm.downgrade, adm.hold) == (False, True, None)
    assert await held(limiter, rule) == 3 * HOLD
