"""The pipe's own RESP packing: byte for byte what redis-py would send."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.limits import lua
from gateway.limits.redis_pipe import Script, ScriptPipe, _Call, _pack
from tests.cache.conftest import RedisServer


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        ([], []),
        (["lgw:lim:{t}:r"], ["", 2, -5, 0, "lease-1"]),
        (["k:{été}", "k2"], ["spend$", 10**15, -(10**15), "名前", 7]),
    ],
)
def test_packing_matches_redis_py(keys: list[str], args: list[int | str]) -> None:
    script = Script.of(lua.SETTLE)
    ours = _pack(_Call(script, keys, args, None))  # type: ignore[arg-type]
    theirs = b"".join(
        aioredis.Connection().pack_commands([("EVALSHA", script.sha, len(keys), *keys, *args)])
    )
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
