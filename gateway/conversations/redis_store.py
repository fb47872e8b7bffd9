"""Stored responses in Redis, shared by every gateway instance.

Layout (``P`` = prefix, ``T`` = ``tenant_key(tenant)``): ``P:T:r:<response id>`` holds the
record with its TTL; the tenant's index is two sorted sets of its ids, ``P:T:w`` in the order
they were written and ``P:T:e`` by when they expire. One Lua script stores a record, drops the
ids whose records expired and, past ``max_entries``, deletes the tenant's oldest written
records, atomically, so concurrent instances keep the bound. (The script names keys it derives
from the prefix: it assumes one Redis, not a cluster.) Every call is bounded by ``timeout_s``;
a failure raises ``StoreUnavailable``.

The write order is the writer's clock in milliseconds, or one past the tenant's newest score
when that is not earlier: scores never tie and never go back, so the record just written is
always the newest, however fast records come or whatever the instances' clocks and ``ttl_s``
(a reload may lower it: new records then expire before old ones, and are still kept over
them). Each index key lives as long as the tenant's longest-lived record.

Earlier versions kept one index, ``P:T:z``, scored by expiry in seconds. A tenant's next write
folds it into ``P:T:w`` (those seconds sort below every millisecond score: its records count as
the oldest, in the order they expire) and ``P:T:e``, and deletes it.

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
from typing import Any, NamedTuple, TypeVar

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

# KEYS: record, written order, expiry, earlier index.
# ARGV: id, record, ttl_s, now (ms), max_entries, record key prefix.
_PUT = """
local id, ttl, now = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
-- Fold in the earlier version's index (expiry in seconds), the live ids only.
local live = '(' .. math.floor(now / 1000)
local earlier = redis.call('ZRANGEBYSCORE', KEYS[4], live, '+inf', 'WITHSCORES')
for i = 1, #earlier, 2 do
  redis.call('ZADD', KEYS[2], 'NX', earlier[i + 1], earlier[i])
  redis.call('ZADD', KEYS[3], 'NX', tonumber(earlier[i + 1]) * 1000, earlier[i])
end
redis.call('DEL', KEYS[4])
-- Ids whose records expired stop counting toward max_entries.
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('ZREM', KEYS[2], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
-- Never a tie, never before the newest: this record is the last to go.
local order = now
local newest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if newest[2] and tonumber(newest[2]) >= order then order = tonumber(newest[2]) + 1 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
redis.call('ZADD', KEYS[2], order, id)
redis.call('ZADD', KEYS[3], now + ttl * 1000, id)
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #oldest, 2 do
    redis.call('ZREM', KEYS[3], oldest[i])
    redis.call('DEL', ARGV[6] .. oldest[i])
  end
end
-- The index lives as long as the longest-lived record (a lowered ttl_s must not cut it short).
local last = string.format('%d', redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIREAT', KEYS[2], last)
redis.call('PEXPIREAT', KEYS[3], last)
return excess
"""


class _TenantKeys(NamedTuple):
    records: str  # the prefix of the record keys
    written: str
    expiry: str
    earlier: str  # the earlier version's index, while its instances may still write it


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

    def _keys(self, tenant: str) -> _TenantKeys:
        base = f"{self.prefix}:{tenant_key(tenant)}"
        return _TenantKeys(f"{base}:r:", f"{base}:w", f"{base}:e", f"{base}:z")

    async def put(self, record: StoredResponse) -> None:
        raw = record.encode()
        if len(raw) > self.limits.max_record_bytes:
            raise RecordTooLarge(f"{len(raw)} bytes over {self.limits.max_record_bytes}")
        tenant = self._keys(record.tenant)
        keys = [tenant.records + record.id, tenant.written, tenant.expiry, tenant.earlier]
        args: list[Any] = [
            record.id,
            raw,
            self.limits.ttl_s,
            int(time.time() * 1000),
            self.limits.max_entries,
            tenant.records,
        ]
        await self._call(lambda: self._put(keys=keys, args=args))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        records = self._keys(tenant).records
        raw = await self._call(lambda: self._redis.get(records + response_id))
        if not isinstance(raw, bytes):
            return None
        record = StoredResponse.decode(raw)
        return record if record.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys = self._keys(tenant)

        async def run() -> int:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(keys.records + response_id)
            for index in (keys.written, keys.expiry, keys.earlier):
                pipe.zrem(index, response_id)
            removed, *_ = await pipe.execute()
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
