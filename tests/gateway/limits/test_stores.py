"""The two limit stores keep one contract: the Lua scripts compute what the Python does."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import NamedTuple

import pytest

from gateway.limits.gcra import Rate
from gateway.limits.memory import MemoryStore
from gateway.limits.store import (
    HELD,
    MICRO,
    SPEND,
    AcquireRequest,
    BucketAdjust,
    BucketTake,
    BudgetGate,
    Hold,
    LimitStore,
    SettleRequest,
    SlotTake,
    UsageAdd,
)
from tests.cache.conftest import RedisServer
from tests.gateway.limits.conftest import Clock, redis_store


class Renewal(NamedTuple):
    leases: tuple[tuple[str, str], ...]
    now: int


RATES = {"r": Rate(5), "k": Rate(1_000), "s": Rate(7, 10_000)}


def random_ops(seed: int, count: int) -> list[tuple[str, object]]:
    """A fixed sequence of acquires, settlements and renewals at advancing times."""
    rng = random.Random(seed)
    ops: list[tuple[str, object]] = []
    holds: list[Hold] = []  # asked for: some taken, some not (a release of those is a no-op)
    now = 1_000_000
    for i in range(count):
        now += rng.choice([0, 0, 1, 7, 150, 2_999, 12_000, 70_000])
        kind = rng.random()
        if kind < 0.6:
            names = rng.sample(sorted(RATES), rng.randint(1, 3))
            buckets = tuple(
                BucketTake(
                    f"t:{n}", RATES[n], rng.choice([1, 2, 300, 999, 1001]) if n == "k" else 1
                )
                for n in names
            )
            # Some takes are a grant's (several leases: L<i>#0, #1, ...).
            slots = (SlotTake("t:c", 5, rng.choice([1, 1, 3])),) if rng.random() < 0.5 else ()
            # A small budget soon spent, or a large one that holds decide (amounts in pUSD,
            # rounded up to micro-dollars: 1 holds 10**6).
            cap = rng.choice([5_000_000, 10**9])
            amount = rng.choice([0, 1, 999_999, 200_000_000, 450_000_000])
            hold = Hold.of("t:u", f"L{i}", amount) if amount else None
            if hold is not None:
                holds.append(hold)
            gate = BudgetGate("t:u", cap, rng.random() < 0.5, hold, 10**7)
            ops.append(("acquire", AcquireRequest(buckets, slots, gate, f"L{i}", 5_000, now)))
        elif kind < 0.9:
            adjusts = (BucketAdjust("t:k", RATES["k"], rng.randint(-1_500, 1_500)),)
            shared = ((SPEND, rng.randint(0, 3_000_000)), ("x:n", 1), ("x:c", 0))
            usage = (
                UsageAdd("t:u", 10**7, shared),  # the store groups records sharing fields
                UsageAdd("t:w", 10**7, shared),
                UsageAdd("t:v", 10**7, ((SPEND, rng.randint(0, 10**15)),)),
            )
            j = rng.randrange(max(1, i))
            # One lease, or a grant's unused ones (space-separated).
            release = rng.choice([f"L{j}", f"L{j}#0", f"L{j}#1 L{j}#2"])
            # A hold released (perhaps again, perhaps expired: each at most once).
            freed = (rng.choice(holds),) if holds and rng.random() < 0.7 else ()
            settle = SettleRequest(adjusts, ("t:c",), release, usage, now, holds=freed)
            ops.append(("settle", settle))
        else:
            leases = tuple(("t:c", f"L{j}") for j in range(max(0, i - 5), i))
            leases += tuple((h.key, h.member) for h in holds[-3:])
            ops.append(("renew", Renewal(leases, now)))
    return ops


async def run(store: LimitStore, ops: list[tuple[str, object]]) -> list[object]:
    out: list[object] = []
    for name, arg in ops:
        if name == "acquire":
            assert isinstance(arg, AcquireRequest)
            out.append(await store.acquire(arg))
        elif name == "settle":
            assert isinstance(arg, SettleRequest)
            out.append(await store.settle(arg))
        else:
            assert isinstance(arg, Renewal)
            leases, now = arg
            await store.renew(leases, 5_000, now)
            record = await store.read_usage("t:u", now)
            out.append(("renewed", len(leases), record[SPEND], record.get(HELD, 0)))
    return out


async def test_redis_scripts_compute_exactly_what_the_memory_store_computes(
    redis_server: RedisServer,
) -> None:
    ops = random_ops(seed=15, count=600)
    memory = await run(MemoryStore(), ops)
    redis = redis_store(redis_server)
    try:
        shared = await run(redis, ops)
    finally:
        await redis.aclose()
    assert len(memory) == 600
    kinds = {type(r).__name__ for r in memory}
    assert {"AcquireResult", "tuple"} <= kinds
    admitted = [r for r in memory if getattr(r, "admitted", False)]
    refused = [r for r in memory if getattr(r, "admitted", True) is False]
    # The sequence exercises every outcome, so agreeing is not agreeing on "always admitted".
    assert admitted and {r.blocked_by for r in refused} == {"bucket", "slot", "budget"}  # type: ignore[attr-defined]
    assert any(r.wait_ms is None for r in refused)  # type: ignore[attr-defined]
    # Holds were taken, held the budget (alone: the spend under the cap) and were reclaimed.
    helds = [r.budget_held for r in memory if hasattr(r, "budget_held")]
    assert max(helds) >= 600_000_000
    assert any(r.over_budget and r.spend < 10**9 for r in refused)  # type: ignore[attr-defined]
    for i, (a, b) in enumerate(zip(memory, shared, strict=True)):
        assert a == b, f"op {i}: {ops[i][0]} memory {a} != redis {b}"


async def test_an_acquire_whose_caller_left_takes_nothing(
    redis_server: RedisServer, clock: Clock
) -> None:
    """A client that gives up while its check waits on a slow Redis: the script still runs and
    admits it, and what it took (its tokens, its leases, a grant's included) goes back when the
    reply it no longer waits for comes. (The memory store never waits: nothing to leave.)"""
    store = redis_store(redis_server)
    takes = (BucketTake("t:k", Rate(1_000), 600),), (SlotTake("t:c", 2, count=2),)
    cap = 10**12  # 1 USD, of which each take holds 0.6

    def gate(hold_id: str) -> BudgetGate:
        return BudgetGate("t:u", cap, True, Hold.of("t:u", hold_id, cap * 6 // 10), 600)

    try:
        await store.renew((("t:c", "none"),), 1_000, clock.ms)  # connected
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            check = asyncio.ensure_future(
                store.acquire(AcquireRequest(*takes, gate("left"), "left", 30_000, clock.ms))
            )
            await asyncio.sleep(0.05)  # written; Redis holds the reply
            check.cancel()
            with pytest.raises(asyncio.CancelledError):
                await check
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        for _ in range(100):  # the reply comes, then the give-back is written
            again = await store.acquire(
                AcquireRequest(*takes, gate("next"), "next", 30_000, clock.ms)
            )
            if again.admitted:
                break
            await asyncio.sleep(0.01)
        # 600 of 1,000 tokens, both slots and 0.6 USD of 1: only with the first take given
        # back whole.
        assert again.admitted and again.held == (2,) and again.budget_held == cap * 6 // 10
    finally:
        await store.aclose()


async def test_acquire_takes_all_rules_or_none(store: LimitStore, clock: Clock) -> None:
    loose, tight = BucketTake("a:r", Rate(100), 1), BucketTake("b:r", Rate(1), 1)
    first = await store.acquire(AcquireRequest((loose, tight), now_ms=clock.ms))
    assert first.admitted and first.debts == (60_000, 60_000)
    second = await store.acquire(AcquireRequest((loose, tight), now_ms=clock.ms))
    assert not second.admitted and second.blocked_by == "bucket" and second.blocked_index == 1
    assert second.wait_ms == 60_000
    # The loose bucket was not charged for the refused request.
    alone = await store.acquire(AcquireRequest((loose,), now_ms=clock.ms))
    assert alone.debts == (120_000,)


async def test_slow_buckets_set_the_wait(store: LimitStore, clock: Clock) -> None:
    a, b = BucketTake("a:r", Rate(2), 1), BucketTake("b:k", Rate(10), 10)
    assert (await store.acquire(AcquireRequest((a, a, b), now_ms=clock.ms))).admitted
    refused = await store.acquire(AcquireRequest((a, b), now_ms=clock.ms))
    # a: 2 taken, refills one per 30 s; b: 10 of 10 taken, 10 come back in 60 s.
    assert (refused.blocked_index, refused.wait_ms) == (1, 60_000)


async def test_slots_are_leases_that_expire_unless_renewed(store: LimitStore, clock: Clock) -> None:
    slot = (SlotTake("t:c", 2),)
    for lease in ("a", "b"):
        got = await store.acquire(AcquireRequest((), slot, None, lease, 1_000, clock.ms))
        assert got.admitted
    full = await store.acquire(AcquireRequest((), slot, None, "c", 1_000, clock.ms))
    assert (full.admitted, full.blocked_by, full.held) == (False, "slot", (2,))
    clock.advance(0.9)
    await store.renew((("t:c", "a"),), 1_000, clock.ms)  # "a" keeps running; "b" crashed
    clock.advance(0.2)
    got = await store.acquire(AcquireRequest((), slot, None, "c", 1_000, clock.ms))
    assert got.admitted and got.held == (2,)  # b expired: its slot came back
    await store.settle(SettleRequest(releases=("t:c",), lease_id="a", now_ms=clock.ms))
    got = await store.acquire(AcquireRequest((), slot, None, "d", 1_000, clock.ms))
    assert got.admitted and got.held == (2,)


async def test_a_grant_takes_several_leases_and_gives_back_the_unused(
    store: LimitStore, clock: Clock
) -> None:
    slot = (SlotTake("t:c", 5, count=4),)
    got = await store.acquire(AcquireRequest((), slot, None, "g", 1_000, clock.ms))
    assert got.admitted and got.held == (4,)
    too_many = await store.acquire(
        AcquireRequest((), (SlotTake("t:c", 5, count=2),), None, "h", 1_000, clock.ms)
    )
    assert (too_many.admitted, too_many.blocked_by, too_many.held) == (False, "slot", (4,))
    # The grant's unused leases go back in one settlement; g#0 (a request) still runs.
    await store.settle(SettleRequest(releases=("t:c",), lease_id="g#1 g#2 g#3", now_ms=clock.ms))
    got = await store.acquire(AcquireRequest((), slot, None, "i", 1_000, clock.ms))
    assert got.admitted and got.held == (5,)  # g#0 and i#0..#3
    await store.settle(SettleRequest(releases=("t:c",), lease_id="g#0", now_ms=clock.ms))
    one = await store.acquire(AcquireRequest((), (SlotTake("t:c", 5),), None, "j", 1_000, clock.ms))
    assert one.admitted and one.held == (5,)


async def test_holds_expire_unless_renewed_and_are_released_once(
    store: LimitStore, clock: Clock
) -> None:
    cap = 10**12  # 1 USD

    def take(name: str, amount: int = 4 * 10**11) -> AcquireRequest:
        gate = BudgetGate("t:u", cap, True, Hold.of("t:u", name, amount), keep_s=600)
        return AcquireRequest((), budget=gate, lease_id=name, lease_ttl_ms=1_000, now_ms=clock.ms)

    def release(*names: str) -> SettleRequest:
        holds = tuple(Hold.of("t:u", n, 4 * 10**11) for n in names)
        return SettleRequest(now_ms=clock.ms, holds=holds)

    assert (await store.acquire(take("a"))).budget_held == 4 * 10**11
    assert (await store.acquire(take("b"))).budget_held == 8 * 10**11
    refused = await store.acquire(take("c"))
    assert (refused.admitted, refused.blocked_by, refused.over_budget) == (False, "budget", True)
    clock.advance(0.6)
    await store.renew((("t:u:h", "b=400000"),), 1_000, clock.ms)
    clock.advance(0.5)  # a's hold expired (its holder stopped renewing it); b's did not
    admitted = await store.acquire(take("c"))
    assert admitted.admitted and admitted.budget_held == 8 * 10**11
    await store.settle(release("a"))  # reclaimed already: nothing more to release
    assert (await store.read_usage("t:u", clock.ms))[HELD] == 8 * 10**11
    for _ in range(2):  # released once, however often it is sent
        await store.settle(release("b"))
        assert (await store.read_usage("t:u", clock.ms))[HELD] == 4 * 10**11
    await store.settle(release("c"))
    assert HELD not in await store.read_usage("t:u", clock.ms)
    too_costly = await store.acquire(take("d", cap + 1))
    assert (too_costly.admitted, too_costly.over_budget) == (False, True)


async def test_money_is_exact_and_carried(store: LimitStore, clock: Clock) -> None:
    adds = [999_999, 1, 123_456_789_012_345, 7, 10**15 * 3 + 5]
    spends = []
    for value in adds:
        add = UsageAdd("t:u", 60, ((SPEND, value), ("chat:cost$", value), ("chat:n", 1)))
        answer = await store.settle(SettleRequest(usage=(add,), now_ms=clock.ms))
        assert answer is not None
        spends.append(answer[0])
    assert spends[-1] == sum(adds)
    assert spends == [sum(adds[: i + 1]) for i in range(len(adds))]
    record = await store.read_usage("t:u", clock.ms)
    assert record[SPEND] == record["chat:cost$"] == sum(adds) and record["chat:n"] == 5


async def test_money_is_exact_up_to_the_largest_budget_a_policy_accepts(
    store: LimitStore, clock: Clock
) -> None:
    """10**12 USD is 10**18 micro-dollars, past 2**53 (where doubles round) and past 10**17
    (which Redis wrote as ``1e+17`` when a script handed it a number, failing the next
    ``HINCRBY`` of the record's held total)."""
    cap = 10**12 * 10**12  # the largest budget, in pUSD
    hold = 10**17 * MICRO  # 50e12 output tokens at 0.002 USD

    def take(name: str, amount: int) -> AcquireRequest:
        gate = BudgetGate("t:u", cap, True, Hold.of("t:u", name, amount), keep_s=600)
        return AcquireRequest((), budget=gate, lease_id=name, lease_ttl_ms=1_000, now_ms=clock.ms)

    first = await store.acquire(take("a", hold))
    assert (first.admitted, first.budget_held) == (True, hold)
    second = await store.acquire(take("b", hold + 1))  # held 2 * 10**17 + 1 micro-dollars
    assert (second.admitted, second.budget_held) == (True, 2 * hold + MICRO)
    assert (await store.read_usage("t:u", clock.ms))[HELD] == 2 * hold + MICRO
    await store.settle(SettleRequest(now_ms=clock.ms, holds=(Hold.of("t:u", "a", hold),)))
    assert (await store.read_usage("t:u", clock.ms))[HELD] == hold + MICRO
    clock.advance(1.5)  # b's hold expires: the next check reclaims it
    # Spent 3 micro-dollars under the cap (a double would round them away: "spent")...
    spent = cap - 3 * MICRO - 1
    add = UsageAdd("t:u", 60, ((SPEND, spent),))
    assert await store.settle(SettleRequest(usage=(add,), now_ms=clock.ms)) == (spent,)
    refused = await store.acquire(take("c", 3 * MICRO + 2))  # holds 4 micro-dollars
    assert (refused.admitted, refused.blocked_by, refused.spend) == (False, "budget", spent)
    assert refused.budget_held == 0  # b's reclaimed
    fits = await store.acquire(take("d", 3 * MICRO))  # spend + 3 micro-dollars: 1 pUSD under
    assert (fits.admitted, fits.budget_held) == (True, 3 * MICRO)
    assert not (await store.acquire(take("e", MICRO))).admitted  # now it is all held
    assert not (await store.acquire(take("f", 10**40))).admitted  # far past any cap
    done = SettleRequest(usage=(add,), now_ms=clock.ms, holds=(Hold.of("t:u", "d", 3 * MICRO),))
    assert await store.settle(done) == (2 * spent,)  # past the cap: still exact
    assert await store.read_usage("t:u", clock.ms) == {SPEND: 2 * spent}


async def test_budget_gate_refuses_only_when_asked(store: LimitStore, clock: Clock) -> None:
    add = UsageAdd("t:u", 60, ((SPEND, 1_000),))
    await store.settle(SettleRequest(usage=(add,), now_ms=clock.ms))
    bucket = (BucketTake("t:r", Rate(10), 1),)

    def gate(cap: int, refuse: bool) -> AcquireRequest:
        return AcquireRequest(bucket, budget=BudgetGate("t:u", cap, refuse), now_ms=clock.ms)

    under = await store.acquire(gate(1_001, True))
    assert under.admitted and under.spend == 1_000
    at_cap = await store.acquire(gate(1_000, True))
    assert (at_cap.admitted, at_cap.blocked_by, at_cap.debts) == (False, "budget", (60_000,))
    report = await store.acquire(gate(1_000, False))
    assert report.admitted and report.spend == 1_000
