"""Stored responses in Redis, shared by every gateway instance.

Layout (``P`` = prefix, ``T`` = ``tenant_key(tenant)``): ``P:T:r:<response id>`` holds the
record with its TTL; ``P:T:z`` is the tenant's sorted set of ids by expiry. One Lua script
stores a record, drops expired ids and, past ``max_entries``, deletes the tenant's
soonest-expiring records, atomically, so concurrent instances keep the bound. (The script
names keys it derives from the prefix: it assumes one Redis, not a cluster.) Every call is
bounded by ``timeout_s``; a failure raises ``StoreUnavailable``.

There is no bound on all tenants' bytes here (the in-memory store's ``max_total_bytes``): a
tenant's writes only ever delete its own records, as in memory. What bounds Redis's memory is
Redis (its ``maxmemory``); an evicting ``maxmemory-policy`` would let Redis drop any tenant's
records, ``noeviction`` makes a full Redis refuse the write (``StoreUnavailable``: served, not
stored).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.conversations import (
    RecordTooLarge,
    StoredResponse,
    StoreLimits,
    StoreUnavailable,
    tenant_key,
)

T = TypeVar("T")

# KEYS: record, index. ARGV: id, record, ttl_s, now, max_entries, record key prefix.
_PUT = """
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[3])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #old, 2 do redis.call('DEL', ARGV[6] .. old[i]) end
end
return excess
"""


class RedisResponseStore:
    def __init__(
        self,
        url: str,
        limits: StoreLimits,
        *,
        prefix: str = "lgw:responses",
        timeout_s: float = 0.5,
    ) -> None:
        self.limits = limits
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        self._put = self._redis.register_script(_PUT)

    def _keys(self, tenant: str) -> tuple[str, str]:
        base = f"{self.prefix}:{tenant_key(tenant)}"
        return f"{base}:r:", f"{base}:z"

    async def put(self, record: StoredResponse) -> None:
        raw = record.encode()
        if len(raw) > self.limits.max_record_bytes:
            raise RecordTooLarge(f"{len(raw)} bytes over {self.limits.max_record_bytes}")
        records, index = self._keys(record.tenant)
        args: list[Any] = [
            record.id,
            raw,
            self.limits.ttl_s,
            int(time.time()),
            self.limits.max_entries,
            records,
        ]
        await self._call(lambda: self._put(keys=[records + record.id, index], args=args))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        records, _ = self._keys(tenant)
        raw = await self._call(lambda: self._redis.get(records + response_id))
        if not isinstance(raw, bytes):
            return None
        record = StoredResponse.decode(raw)
        return record if record.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        records, index = self._keys(tenant)

        async def run() -> int:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(records + response_id)
            pipe.zrem(index, response_id)
            removed, _ = await pipe.execute()
            return int(removed)

        return bool(await self._call(run))

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fn()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"the response store did not answer: {exc}") from exc
