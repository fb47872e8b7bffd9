"""The Redis limit store when Redis misbehaves: slow answers, lost replies, refusals, a server
that accepts connections and never answers, wrong credentials. Faults are made with a small
TCP proxy in front of a real redis-server (each connection's traffic held or dropped on
demand), with SIGSTOP, or with Redis's own settings (``maxmemory``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.limits import redis_store
from gateway.limits.check import LimitExceeded
from gateway.limits.cost import Usage
from gateway.limits.gcra import Rate
from gateway.limits.limiter import Limiter
from gateway.limits.redis_pipe import Script, ScriptPipe
from gateway.limits.redis_store import RedisLimitStore
from gateway.limits.rules import RateLimits, Subject
from gateway.limits.store import (
    HELD,
    SPEND,
    AcquireRequest,
    BucketTake,
    BudgetGate,
    Hold,
    LimitCounts,
    LimitStore,
    ScriptError,
    SettleRequest,
    SlotTake,
    StoreUnavailable,
)
from gateway.limits.usage import UsageRecord
from gateway.limits.windows import Window, window_of
from gateway.observability.usage_metrics import LimiterCollector
from tests.cache.conftest import RedisServer
from tests.gateway.limits.conftest import Clock

pytestmark = pytest.mark.redis


class Proxy:
    """A TCP proxy in front of Redis. ``hold_up``: what clients send waits in the proxy
    (Redis has not run it) until ``release``; ``drop_down``: Redis's replies are read and
    dropped (Redis ran the commands, their answers are lost)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.hold_up = False
        self.drop_down = False
        self._released = asyncio.Event()
        self.held = 0  # chunks waiting in the proxy
        self.late = asyncio.Event()  # held bytes of a connection its client left: written
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def release(self) -> None:
        self.hold_up = False
        self._released.set()

    async def aclose(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
        for coro in (self._up(cr, sw), self._down(sr, cw)):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _up(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buffered: list[bytes] = []
        try:
            while data := await r.read(65536):
                if self.hold_up:
                    buffered.append(data)
                    self.held += 1
                    continue
                w.write(b"".join(buffered) + data)
                buffered.clear()
        except (ConnectionError, OSError):
            pass
        # The client went away (it gave up): what it sent reaches Redis all the same, late.
        if buffered:
            await self._released.wait()
            w.write(b"".join(buffered))
        with contextlib.suppress(ConnectionError, OSError):
            await w.drain()
        w.close()
        if buffered:
            self.late.set()

    async def _down(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(65536):
                if not self.drop_down:
                    w.write(data)
        w.close()


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[Proxy]:
    p = Proxy(redis_server.port)
    await p.start()
    yield p
    await p.aclose()


CAP = 10**12  # 1 USD, of which each request holds 0.6


def take(name: str, clock: Clock) -> AcquireRequest:
    """Tokens (600 of 1,000), both slots of two (a grant's shape: two leases) and 0.6 USD of
    1: a second such take fits only when the first took nothing."""
    gate = BudgetGate("{t}:u", CAP, True, Hold.of("{t}:u", name, CAP * 6 // 10), 600)
    return AcquireRequest(
        (BucketTake("{t}:k", Rate(1_000), 600),),
        (SlotTake("{t}:c", 2, count=2),),
        gate,
        name,
        30_000,
        clock.ms,
    )


async def warm(store: RedisLimitStore, clock: Clock) -> None:
    """Connected, the check's script known to Redis (else the lost answer is a NOSCRIPT)."""
    warmup = AcquireRequest((BucketTake("{w}:r", Rate(10), 1),), now_ms=clock.ms)
    assert (await store.acquire(warmup)).admitted


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


async def admitted(store: LimitStore, clock: Clock) -> Callable[[], Awaitable[bool]]:
    count = 0

    async def check() -> bool:
        nonlocal count
        count += 1
        with contextlib.suppress(StoreUnavailable):
            result = await store.acquire(take(f"probe-{count}", clock))
            if result.admitted:
                return True
        return False

    return check


async def test_a_check_whose_answer_was_lost_takes_nothing(proxy: Proxy, clock: Clock) -> None:
    """Redis runs the check and admits it, but its answer never comes back in time: the
    caller counts Redis as unavailable, and what the check took (tokens, both leases, the
    budget hold) is given back once Redis answers again, not held for the lease's TTL."""
    store = RedisLimitStore(proxy.url, timeout_s=0.3, retry_after_s=0.1)
    try:
        await warm(store, clock)
        proxy.drop_down = True
        with pytest.raises(StoreUnavailable) as lost:
            await store.acquire(take("lost", clock))
        assert lost.value.maybe_applied
        proxy.drop_down = False
        assert await eventually(await admitted(store, clock))
    finally:
        await store.aclose()


async def test_undos_past_the_bound_are_dropped_and_counted_on_metrics(
    proxy: Proxy, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Undos wait in memory while Redis is away, at most ``MAX_UNDOS``: the older ones are
    dropped, and ``/metrics`` says how many (a total carried across reloads)."""
    monkeypatch.setattr(redis_store, "MAX_UNDOS", 2)
    counts = LimitCounts()
    store = RedisLimitStore(proxy.url, timeout_s=0.2, retry_after_s=0.0, counts=counts)
    try:
        await warm(store, clock)
        proxy.drop_down = True  # every answer lost: the checks' and their undos'
        for n in range(4):
            with pytest.raises(StoreUnavailable) as lost:
                await store.acquire(take(f"lost-{n}", clock))
            assert lost.value.maybe_applied

        async def dropped() -> bool:  # four undos, two kept: the other two dropped
            return counts.undos_dropped >= 2

        assert await eventually(dropped)
        registry = CollectorRegistry()
        registry.register(LimiterCollector(lambda: Limiter(store, counts=counts)))
        told = registry.get_sample_value("llm_gateway_limits_undos_dropped_total")
        assert told == counts.undos_dropped
    finally:
        await store.aclose()


async def test_a_check_that_reaches_redis_after_it_was_given_up_takes_nothing(
    proxy: Proxy, clock: Clock
) -> None:
    """The check is written, times out, and reaches Redis only after its undo has run (on
    another connection): it must take nothing then either."""
    store = RedisLimitStore(proxy.url, timeout_s=0.3, retry_after_s=0.1)
    try:
        await warm(store, clock)
        proxy.hold_up = True
        with pytest.raises(StoreUnavailable):
            await store.acquire(take("late", clock))
        assert proxy.held == 1
        proxy.hold_up = False  # new connections pass; the old one's bytes still wait
        assert await eventually(await admitted(store, clock))  # the undo came first
        # Free the slots again, then let the late check through: it must take nothing.
        admin = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.target}/0")
        await admin.delete("{t}:c", "{t}:k", "{t}:u", "{t}:u:h")
        clients = len(await admin.client_list())  # the late one's included
        proxy.release()
        await asyncio.wait_for(proxy.late.wait(), 10)

        async def ran() -> bool:  # Redis read it, ran it, then closed its connection
            return len(await admin.client_list()) < clients

        assert await eventually(ran)
        assert await admin.zcard("{t}:c") == 0
        assert await admin.exists("{t}:k", "{t}:u:h") == 0
        await admin.aclose()
    finally:
        await store.aclose()


async def test_a_limiter_check_that_timed_out_leaves_no_request_in_flight(
    proxy: Proxy,
) -> None:
    """The probe's symptom: after a slow check, with nothing in flight, the tenant was
    refused "N requests in flight" for the whole lease TTL (fail closed and open alike)."""
    lim = Limiter(RedisLimitStore(proxy.url, timeout_s=0.3, retry_after_s=0.1), fail_open=False)
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=3, max_concurrent=1))
    try:
        first = await lim.admit(subject, 1)
        lim.finish(first, None)
        await lim.drain()
        proxy.drop_down = True
        with pytest.raises(LimitExceeded) as refused:
            await lim.admit(subject, 1)
        assert refused.value.reason == "unavailable"
        proxy.drop_down = False

        async def fits() -> bool:
            try:
                admission = await lim.admit(subject, 1)
            except LimitExceeded:
                return False
            lim.finish(admission, None)
            await lim.drain()
            return True

        assert await eventually(fits)
        # 3 a minute: the first, the lost one (given back) and the one above, then one more.
        assert await fits()
    finally:
        await lim.aclose()


def _client_sockets_to(port: int) -> int:
    """Established TCP connections to ``port`` on loopback (client ends: remote port)."""
    count = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            parts = line.split()
            remote, state = parts[2], parts[3]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


async def test_connecting_to_a_server_that_never_answers_auth_leaks_no_socket(
    password_redis_server: tuple[int, int],
) -> None:
    port, pid = password_redis_server
    pipe = ScriptPipe(f"redis://:s3cret@127.0.0.1:{port}/0", timeout_s=0.05)
    before = _client_sockets_to(port)
    os.kill(pid, signal.SIGSTOP)  # the kernel still accepts connections; Redis never answers
    try:
        for _ in range(5):
            with pytest.raises(StoreUnavailable):
                await pipe.call(Script.of("return 1"), [], [])
        await asyncio.sleep(0.1)
        assert _client_sockets_to(port) <= before
    finally:
        os.kill(pid, signal.SIGCONT)
        await pipe.aclose()


async def test_a_wrong_password_is_named_without_the_password(
    password_redis_server: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    port, _ = password_redis_server
    store = RedisLimitStore(f"redis://:hunter2@127.0.0.1:{port}/0", timeout_s=1.0)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="llm_gateway.limits"),
            pytest.raises(StoreUnavailable) as refused,
        ):
            await store.renew((("{t}:c", "x"),), 1_000, None)
        assert "WRONGPASS" in str(refused.value)
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "WRONGPASS" in logged and "hunter2" not in logged
    finally:
        await store.aclose()


async def test_redis_refusing_writes_is_an_outage_not_a_bug(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory (and READONLY, NOAUTH, LOADING, BUSY...): Redis refuses our scripts.
    That is Redis unavailable, counted and warned about once, not a script error of ours."""
    store = RedisLimitStore(redis_server.url, timeout_s=1.0, retry_after_s=0.05)
    lim = Limiter(store, fail_open=True)
    subject = Subject("team-a", "chat", RateLimits(requests_per_minute=100))
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await lim.admit(subject, 1)
        await admin.config_set("maxmemory", 100_000)  # far below what Redis uses already
        with caplog.at_level(logging.WARNING, logger="llm_gateway.limits"):
            for _ in range(3):
                assert (await lim.admit(subject, 1)).degraded
                await asyncio.sleep(0.06)  # past the back-off: Redis asked again
        assert lim.counts.unavailable == {"open": 3}
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        warned = [r.getMessage() for r in caplog.records if "store unavailable (" in r.getMessage()]
        assert len(warned) == 1 and "OOM" in warned[0]
        await admin.config_set("maxmemory", 0)
        assert not (await lim.admit(subject, 1)).degraded
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
        await lim.aclose()


def day(clock: Clock) -> Window:
    return window_of("day", clock())


async def test_a_script_error_fails_its_own_call_only(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A script that fails (here a key of one tenant's that is not a hash) is that call's
    failure, a bug or a bad input: logged as an error once per kind, while Redis keeps serving
    every other call (no back-off: other tenants keep their limits)."""
    store = RedisLimitStore(redis_server.url, timeout_s=1.0, retry_after_s=30.0)
    admin = aioredis.Redis.from_url(redis_server.url)
    other = AcquireRequest((BucketTake("{b}:r", Rate(2), 1),))
    try:
        await admin.set("{a}:r", "not a hash")
        broken = AcquireRequest((BucketTake("{a}:r", Rate(10), 1),))
        with caplog.at_level(logging.WARNING, logger="llm_gateway.limits"):
            for _ in range(3):
                with pytest.raises(StoreUnavailable) as failed:
                    await store.acquire(broken)
                assert isinstance(failed.value, ScriptError)
                assert not failed.value.maybe_applied
            assert [(await store.acquire(other)).admitted for _ in range(3)] == [True, True, False]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "ACQUIRE" in errors[0] and "WRONGTYPE" in errors[0]
        assert not any("unavailable" in r.getMessage() for r in caplog.records)
        assert (store.script_errors, store.failures, store.available) == (3, 0, True)
    finally:
        await admin.aclose()
        await store.aclose()


async def test_a_limiter_answers_a_failed_check_alone_and_drops_a_failed_settlement(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The request whose check failed gets the configured direction (here: admitted without
    limits), and the others keep theirs; a settlement that fails in its script is dropped,
    not resent forever ahead of every other tenant's usage, and ``/metrics`` counts its
    records (a total a reload's new limiter counts on from)."""
    store = RedisLimitStore(redis_server.url, timeout_s=1.0, retry_after_s=30.0)
    clock = Clock()
    lim = Limiter(store, fail_open=True, clock=clock)
    admin = aioredis.Redis.from_url(redis_server.url)
    broken = Subject("team-a", "chat", RateLimits(requests_per_minute=100))
    other = Subject("team-b", "chat", RateLimits(requests_per_minute=2))
    try:
        for key in (lim.keys.scope("team-a") + ":r", lim.keys.record("team-a", day(clock))):
            await admin.set(key, "not a hash")
        with caplog.at_level(logging.WARNING, logger="llm_gateway.limits"):
            admission = await lim.admit(broken, 1)
            assert admission.degraded
            assert (await lim.admit(other, 1)).degraded is False
            assert (await lim.admit(other, 1)).degraded is False
            with pytest.raises(LimitExceeded) as refused:
                await lim.admit(other, 1)
            assert refused.value.reason == "requests"
            answer = UsageRecord("chat", "m", Usage(5, 0, 6), cost=17 * 10**9)
            lim.ledger.defer(broken, answer)  # its day record is broken: fails in the script
            lim.ledger.defer(other, answer)
            await lim.flush()
        assert lim.counts.unavailable == {"open": 1}
        assert not any("unavailable" in r.getMessage() for r in caplog.records)
        assert lim.counts.records_lost == {"script_error": 3} and not lim.ledger.waiting
        report = await store.read_usage(lim.keys.record("team-b", day(clock)))
        assert (report["chat:n"], report[SPEND]) == (1, 17 * 10**9)
        registry = CollectorRegistry()
        registry.register(LimiterCollector(lambda: Limiter(store, counts=lim.counts)))
        told = registry.get_sample_value(
            "llm_gateway_limits_records_lost_total", {"reason": "script_error"}
        )
        assert told == 3
    finally:
        await admin.aclose()
        await lim.aclose()


async def test_the_usage_report_leaves_out_expired_holds(store: LimitStore, clock: Clock) -> None:
    gate = BudgetGate("{t}:u", CAP, True, Hold.of("{t}:u", "h1", CAP // 10), 600)
    assert (await store.acquire(AcquireRequest((), (), gate, "h1", 1_000, clock.ms))).admitted
    assert (await store.read_usage("{t}:u", clock.ms)).get(HELD, 0) == CAP // 10
    clock.advance(2)  # its holder stopped renewing it (crashed): it expired
    assert (await store.read_usage("{t}:u", clock.ms)).get(HELD, 0) == 0
    # A release afterwards changes nothing.
    await store.settle(SettleRequest(holds=(gate.hold,), now_ms=clock.ms))  # type: ignore[arg-type]
    assert (await store.read_usage("{t}:u", clock.ms)).get(HELD, 0) == 0


async def test_a_usage_report_after_a_redis_restart_is_read_on_a_fresh_connection(
    redis_server: RedisServer,
) -> None:
    """The reports' pooled connection went stale in the restart: the first ``/admin/usage``
    after Redis came back was a 503 (the probe's repro), the next ones 200."""
    store = RedisLimitStore(redis_server.url, timeout_s=1.0)
    try:
        empty = await store.read_usage("{t}:u")
        redis_server.stop()
        redis_server.start()
        assert await store.read_usage("{t}:u") == empty
    finally:
        await store.aclose()
