"""The pipe: its own RESP packing (byte for byte what redis-py would send) and its own
transport (batches, scripts the server forgot, credentials, failures and what they say)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
import uvloop

from gateway.limits import lua
from gateway.limits.redis_pipe import Script, ScriptPipe, _Call, _pack
from gateway.limits.store import StoreUnavailable
from tests.cache.conftest import RedisServer, free_port


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        ([], []),
        (["lgw:lim:{t}:r"], ["", 2, -5, 0, "lease-1"]),
        (["k:{été}", "k2"], ["spend$", 10**15, -(10**15), "名前", 7]),
    ],
)
@pytest.mark.parametrize("whole", [False, True], ids=["evalsha", "eval"])
def test_packing_matches_redis_py(keys: list[str], args: list[int | str], whole: bool) -> None:
    script = Script.of(lua.SETTLE)
    ours = _pack(_Call(script, keys, args, None), whole)  # type: ignore[arg-type]
    command = ("EVAL", script.text) if whole else ("EVALSHA", script.sha)
    theirs = b"".join(aioredis.Connection().pack_commands([(*command, len(keys), *keys, *args)]))
    assert ours == theirs


async def test_a_burst_travels_in_few_writes_and_every_call_gets_its_own_answer(
    redis_server: RedisServer,
) -> None:
    pipe = ScriptPipe(redis_server.url, timeout_s=2.0, connections=2, max_batch=64)
    echo = Script.of("return tonumber(ARGV[1]) * 2")
    try:
        answers = await asyncio.gather(*(pipe.call(echo, [], [i]) for i in range(500)))
        assert answers == [2 * i for i in range(500)]
        # Two single calls go at once; the rest wait for a connection and leave 64 at a time.
        assert pipe.batches <= 2 + -(-498 // 64)
        assert len(pipe._idle) <= 2  # never more connections than asked
    finally:
        await pipe.aclose()


async def test_scripts_the_server_forgot_are_loaded_and_their_calls_sent_again(
    redis_server: RedisServer,
) -> None:
    pipe = ScriptPipe(redis_server.url, timeout_s=2.0, connections=1)
    echo = Script.of("return tonumber(ARGV[1]) + 1")
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await pipe.call(echo, [], [1]) == 2
        await admin.script_flush()  # what a restart does to the script cache
        assert await asyncio.gather(*(pipe.call(echo, [], [i]) for i in range(5))) == [
            1,
            2,
            3,
            4,
            5,
        ]
        assert await pipe.call(echo, [], [9]) == 10
    finally:
        await admin.aclose()
        await pipe.aclose()


async def noscripts(admin: aioredis.Redis) -> int:
    """The calls Redis answered NOSCRIPT since its stats were reset."""
    stats = await admin.info("errorstats")
    return int(stats.get("errorstat_NOSCRIPT", {}).get("count", 0))


async def test_after_a_flush_only_the_call_that_meets_it_pays_a_round_trip(
    redis_server: RedisServer,
) -> None:
    """A flushed cache (or a restarted server) has lost every script: once one call meets the
    flush, every other script goes whole (EVAL), with no NOSCRIPT and no round trip more. A
    settlement that waited for its own reload was overtaken by the same client's next check
    (sent meanwhile on another connection), which found the finished request's slot taken."""
    pipe = ScriptPipe(redis_server.url, timeout_s=2.0, connections=2)
    check = Script.of("return redis.call('INCR', KEYS[1])")
    settle = Script.of("return redis.call('DECR', KEYS[1])")
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await pipe.call(check, ["n"], []) == 1  # each first call goes whole
        assert await pipe.call(settle, ["n"], []) == 0
        await admin.config_resetstat()
        await admin.script_flush()
        assert await pipe.call(check, ["n"], []) == 1  # meets the flush: sent again whole
        assert await noscripts(admin) == 1
        assert await pipe.call(settle, ["n"], []) == 0
        assert await pipe.call(check, ["n"], []) == 1
        assert await noscripts(admin) == 1  # the settlement went whole at once
        await admin.script_flush()
        await admin.client_kill_filter(_type="normal", skipme=True)  # as a restart does
        for _ in range(500):  # until the pipe has seen its connections close
            if all(link.lost for link in pipe._idle):
                break
            await asyncio.sleep(0.01)
        assert await pipe.call(settle, ["n"], []) == 0  # whole: it may be a new server
        assert await noscripts(admin) == 1
    finally:
        await admin.aclose()
        await pipe.aclose()


async def test_password_and_database_from_the_url(
    password_redis_server: tuple[int, int],
) -> None:
    port, _ = password_redis_server
    count = Script.of("redis.call('INCR', KEYS[1]); return redis.call('GET', KEYS[1])")
    good = ScriptPipe(f"redis://:s3cret@127.0.0.1:{port}/3", timeout_s=2.0)
    try:
        assert await good.call(count, ["k"], []) == b"1"
    finally:
        await good.aclose()
    check = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{port}/3")
    assert await check.get("k") == b"1"  # in database 3, not 0
    await check.aclose()
    wrong = ScriptPipe(f"redis://:nope@127.0.0.1:{port}/0", timeout_s=2.0)
    with pytest.raises(StoreUnavailable) as refused:
        await wrong.call(count, ["k"], [])
    assert not refused.value.maybe_applied
    await wrong.aclose()


async def test_no_server_fails_at_once_and_nothing_was_applied() -> None:
    pipe = ScriptPipe(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(StoreUnavailable) as failed:
        await pipe.call(Script.of("return 1"), [], [])
    assert not failed.value.maybe_applied
    await pipe.aclose()


async def test_a_server_that_never_answers_times_out_and_the_call_may_have_run() -> None:
    received = bytearray()

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read(65536))
        await asyncio.sleep(5)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = ScriptPipe(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as failed:
            await pipe.call(Script.of("return 1"), [], [])
        assert failed.value.maybe_applied
        assert time.monotonic() - started < 1.0
        assert received.startswith(b"*3\r\n$4\r\nEVAL\r\n")  # a script's first call: whole
    finally:
        await pipe.aclose()
        server.close()


def test_the_pipe_under_uvloop_the_loop_the_gateway_serves_with(
    redis_server: RedisServer,
) -> None:
    # uvloop's transports are not asyncio.Transport subclasses: the protocol must not care.
    async def scenario() -> list[int]:
        pipe = ScriptPipe(redis_server.url, timeout_s=2.0, connections=2, max_batch=16)
        echo = Script.of("return tonumber(ARGV[1]) * 3")
        try:
            return list(await asyncio.gather(*(pipe.call(echo, [], [i]) for i in range(100))))
        finally:
            await pipe.aclose()

    assert uvloop.run(asyncio.wait_for(scenario(), 10)) == [3 * i for i in range(100)]


async def test_a_check_does_not_wait_for_a_settlement_in_flight(
    redis_server: RedisServer,
) -> None:
    """A settlement is written at once; a check made meanwhile is written on another
    connection rather than queued behind it (Redis itself then runs them in order)."""
    pipe = ScriptPipe(redis_server.url, timeout_s=2.0, connections=2)
    slow = Script.of(  # busy for ARGV[1] microseconds
        "local s = redis.call('TIME') repeat local n = redis.call('TIME')"
        " until (n[1] - s[1]) * 1000000 + (n[2] - s[2]) >= tonumber(ARGV[1]) return 2"
    )
    quick = Script.of("return 1")
    try:
        await pipe.call(quick, [], [])
        assert await pipe.call(slow, [], [0]) == 2  # connected, both scripts known
        sent = pipe.batches
        settlement = asyncio.ensure_future(pipe.call(slow, [], [500_000]))
        await asyncio.sleep(0)
        assert pipe.batches == sent + 1  # written at once, nothing waits for company
        check = asyncio.ensure_future(pipe.call(quick, [], []))
        # The second link connects while Redis runs the settlement (half a second: a loaded
        # machine's connect fits in it); queued behind it, the check would be written only
        # once the settlement is done.
        while pipe.batches < sent + 2 and not settlement.done():  # noqa: ASYNC110 (no event)
            await asyncio.sleep(0.005)
        assert pipe.batches == sent + 2 and not settlement.done()  # the check is on its way
        assert await check == 1
        assert await settlement == 2
    finally:
        await pipe.aclose()
