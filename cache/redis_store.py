"""Redis-backed ``CacheStore``: entries shared by every gateway instance.

Layout (``P`` = key prefix, ``S`` = ``CacheScope.path()``: digests of tenant, namespace, model):

* ``P:x:S:<exact key>``    hash {s: scope JSON, r: response}, with the exact TTL;
* ``P:e:S:<entry id>``     hash {s, c: context key, t: query text, v: float32 vector,
                           x: expiry (unix s), r: response}, with the semantic TTL;
* ``P:z:S``                sorted set of the scope's entry ids by expiry, for ``max_entries``
                           and for expiry: each store in a scope reads the ids past their
                           expiry out of it and deletes them (a ``del`` event each), so that
                           no instance's index keeps an entry Redis let expire;
* ``P:events``             stream of changes: add (scope path and entry id), del (evicted or
                           expired id), purge (scope prefix); trimmed to ``stream_maxlen``.

Each instance's sync task loads every ``P:e:*`` entry into its faiss index at start (and
after any lost connection, since Redis may have restarted empty), then follows the stream
from the id it read before the load, so an entry stored by one instance is found by all.
An add event names its entry and the follower reads the entry's hash (query text, vector):
the stream, which outlives entries (no TTL, ``stream_maxlen`` events), holds no prompt text
and no vector, only digests; an entry gone (expired, purged) before it is read is skipped.
Every ``sweep_interval_s`` it also drops from its index the entries past their expiry that
no store in their scope has deleted yet (a scope nobody writes to any more).

Redis down or slow: every request-path call is bounded by ``timeout_s``; the first failure
logs one warning and opens a back-off window of ``retry_after_s`` during which calls fail
at once with ``StoreUnavailable`` (the caches answer "miss"); the first success after it logs
the recovery. ``failures`` counts failed calls for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT

from cache.index import IndexEntry
from cache.keys import CacheScope, scope_prefix
from cache.store import IndexSink, StoredResponse, StoreUnavailable, notify

log = logging.getLogger(__name__)

T = TypeVar("T")
_ERRORS = (RedisError, OSError, TimeoutError)
Messages = list[tuple[bytes, dict[bytes, bytes]]]  # a stream's (id, fields), as XREAD reads


def _scope_json(scope: CacheScope) -> bytes:
    return json.dumps([scope.tenant, scope.model, scope.namespace]).encode()


def _scope_from(raw: bytes | None) -> CacheScope | None:
    if raw is None:
        return None
    tenant, model, namespace = json.loads(raw)
    return CacheScope(tenant=tenant, model=model, namespace=namespace)


def _member(member: bytes | str) -> str:
    return member.decode() if isinstance(member, bytes) else str(member)


def _entry_from(entry_id: str, fields: dict[bytes, bytes]) -> IndexEntry | None:
    scope = _scope_from(fields.get(b"s"))
    vector = fields.get(b"v")
    if scope is None or vector is None:
        return None
    return IndexEntry(
        entry_id=entry_id,
        scope=scope,
        context_key=fields.get(b"c", b"").decode(),
        text=fields.get(b"t", b"").decode("utf-8", "replace"),
        vector=np.frombuffer(vector, dtype=np.float32).copy(),
        expires_at=float(fields.get(b"x", b"0")),
    )


class RedisStore:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "lgw:cache",
        timeout_s: float = 0.05,
        retry_after_s: float = 1.0,
        stream_maxlen: int = 100_000,
        block_ms: int = 1000,
        load_timeout_s: float = 10.0,
        max_connections: int = 64,
        sweep_interval_s: float = 30.0,
    ) -> None:
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.stream_maxlen = stream_maxlen
        self._block_ms = block_ms
        self._load_timeout_s = load_timeout_s
        self._sweep_interval_s = sweep_interval_s
        self._next_sweep = time.monotonic() + sweep_interval_s
        self._stream = f"{prefix}:events"
        # A blocking pool: a burst beyond max_connections waits for a free connection
        # (bounded by the call's timeout) instead of failing. ``from_pool`` hands the pool to
        # the client, so ``aclose`` closes its connections too (a client given a pool through
        # ``connection_pool=`` leaves it open: each store a reload replaced kept up to
        # ``max_connections`` sockets to Redis).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=None,
            socket_connect_timeout=max(timeout_s, 0.2),
            socket_timeout=5.0,
        )
        self._redis = aioredis.Redis.from_pool(pool)
        self._follower = aioredis.Redis.from_url(
            url, socket_connect_timeout=1.0, socket_timeout=block_ms / 1000 + 5.0
        )
        self._sinks: list[IndexSink] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._loaded = asyncio.Event()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self.failures = 0
        self.events_applied = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def attach(self, sink: IndexSink) -> None:
        self._sinks.append(sink)

    async def start(self) -> None:
        """Start following Redis; wait (bounded) for the first full load, never raise."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="redis-cache-sync")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._load_timeout_s):
                await self._loaded.wait()

    async def aclose(self) -> None:
        # redis-py may not honour a cancel that lands inside a blocking XREAD: ask the
        # follower to stop after its current read (at most block_ms), then cancel as a fallback.
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=self._block_ms / 1000 + 1.0)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
        await self._redis.aclose()
        await self._follower.aclose()

    async def retune(self, *, timeout_s: float, max_bytes: int) -> None:
        """A reload's ``timeout_ms`` bounds the next calls (Redis bounds its own memory)."""
        self.timeout_s = timeout_s

    @property
    def available(self) -> bool:
        """False during the back-off window after a failure; then one call may try again."""
        return self._down_since is None or time.monotonic() >= self._retry_at

    # ---- request path ----------------------------------------------------------------------

    async def get_exact(self, scope: CacheScope, key: str) -> StoredResponse | None:
        name = f"{self.prefix}:x:{scope.path()}:{key}"
        raw = await self._call(lambda r: r.hmget(name, ["s", "r"]))
        return self._checked(scope, raw)

    async def put_exact(self, scope: CacheScope, key: str, response: bytes, ttl_s: int) -> None:
        name = f"{self.prefix}:x:{scope.path()}:{key}"

        async def run(r: aioredis.Redis) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.hset(name, mapping={"s": _scope_json(scope), "r": response})
            pipe.expire(name, ttl_s)
            await pipe.execute()

        await self._call(run)

    async def get_response(self, scope: CacheScope, entry_id: str) -> StoredResponse | None:
        name = f"{self.prefix}:e:{scope.path()}:{entry_id}"
        raw = await self._call(lambda r: r.hmget(name, ["s", "r"]))
        return self._checked(scope, raw)

    async def put_entry(
        self, entry: IndexEntry, response: bytes, ttl_s: int, max_entries: int
    ) -> None:
        path = entry.scope.path()
        name = f"{self.prefix}:e:{path}:{entry.entry_id}"
        zname = f"{self.prefix}:z:{path}"
        fields: dict[EncodableT, EncodableT] = {
            "s": _scope_json(entry.scope),
            "c": entry.context_key,
            "t": entry.text,
            "v": np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes(),
            "x": repr(entry.expires_at),
        }

        async def run(r: aioredis.Redis) -> None:
            now = time.time()
            pipe = r.pipeline(transaction=True)
            pipe.hset(name, mapping={**fields, "r": response})
            pipe.expire(name, ttl_s)
            pipe.zadd(zname, {entry.entry_id: entry.expires_at})
            # Read what expired before removing it: Redis expires the hashes without a
            # word, and every instance's index must drop them too.
            pipe.zrangebyscore(zname, "-inf", now)
            pipe.zremrangebyscore(zname, "-inf", now)
            pipe.expire(zname, 2 * ttl_s)  # outlives its members: their ids are read back
            pipe.zcard(zname)
            pipe.xadd(
                self._stream,
                {"op": "add", "p": path, "i": entry.entry_id},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
            results = await pipe.execute()
            expired = [_member(m) for m in results[3]]
            excess = int(results[-2]) - max_entries
            if excess > 0:
                victims: list[tuple[bytes, float]] = await r.zpopmin(zname, excess)  # type: ignore[assignment]
                expired += [_member(m) for m, _score in victims]
            if expired:
                await self._drop(r, path, expired)

        await self._call(run)
        await notify(self._sinks, lambda sink: sink.add(entry))

    async def _drop(self, r: aioredis.Redis, path: str, entry_ids: list[str]) -> None:
        """Delete entries (evicted, or expired) here and in every instance's index."""
        pipe = r.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.unlink(f"{self.prefix}:e:{path}:{entry_id}")
            pipe.xadd(
                self._stream,
                {"op": "del", "i": entry_id},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
        await pipe.execute()
        await notify(self._sinks, lambda sink: [sink.remove(e) for e in entry_ids])

    async def purge(self, tenant: str, namespace: str | None = None) -> int:
        prefix = scope_prefix(tenant, namespace)

        async def run(r: aioredis.Redis) -> int:
            removed = 0
            for kind in ("x", "e", "z"):
                batch: list[bytes] = []
                async for key in r.scan_iter(match=f"{self.prefix}:{kind}:{prefix}*", count=1000):
                    batch.append(key)
                    if len(batch) >= 500:
                        removed += int(await r.unlink(*batch)) if kind != "z" else 0
                        batch = []
                if batch:
                    deleted = int(await r.unlink(*batch))
                    removed += deleted if kind != "z" else 0
            await r.xadd(
                self._stream,
                {"op": "purge", "p": prefix},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
            return removed

        # A purge is an admin call: give it longer than a lookup, and let its errors surface.
        removed = await self._call(run, timeout_s=max(self.timeout_s, 30.0))
        await notify(self._sinks, lambda sink: sink.purge(prefix))
        return removed

    def _checked(self, scope: CacheScope, raw: list[bytes | str | None]) -> StoredResponse | None:
        stored_scope, response = raw[0], raw[1]
        if not isinstance(stored_scope, bytes) or not isinstance(response, bytes):
            return None
        if _scope_from(stored_scope) != scope:
            return None  # a digest collision at worst: never serve another scope's answer
        return StoredResponse(scope, response)

    async def _call(
        self, op: Callable[[aioredis.Redis], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        now = time.monotonic()
        if self._down_since is not None and now < self._retry_at:
            raise StoreUnavailable("redis cache store is in back-off")
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                result = await op(self._redis)
        except _ERRORS as exc:
            self._failed(exc)
            raise StoreUnavailable(f"redis: {type(exc).__name__}") from exc
        self._recovered()
        return result

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self._retry_at = time.monotonic() + self.retry_after_s
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "redis cache store unavailable (%s); serving without cache", type(exc).__name__
            )

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.warning("redis cache store back after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    # ---- keeping the local index in step ---------------------------------------------------

    async def _follow(self) -> None:
        last_id: bytes | None = None
        while not self._closing:
            try:
                if last_id is None:
                    last_id = await self._full_load()
                    self._loaded.set()
                reply: Any = await self._follower.xread(
                    {self._stream: last_id}, count=500, block=self._block_ms
                )
                for _stream, messages in reply or []:
                    if messages:
                        last_id = messages[-1][0]
                        added = await self._added(messages)
                        await asyncio.to_thread(self._apply, messages, added)
                if time.monotonic() >= self._next_sweep:
                    self._next_sweep = time.monotonic() + self._sweep_interval_s
                    await notify(self._sinks, lambda sink: sink.sweep())
            except asyncio.CancelledError:
                raise
            except _ERRORS as exc:
                self._failed(exc)
                last_id = None  # reload in full: Redis may have come back empty
                await asyncio.sleep(self.retry_after_s)

    async def _full_load(self) -> bytes:
        r = self._follower
        newest: Any = await r.xrevrange(self._stream, count=1)
        last_id: bytes = newest[0][0] if newest else b"0-0"
        entries: list[IndexEntry] = []
        names: list[bytes] = []
        async for name in r.scan_iter(match=f"{self.prefix}:e:*", count=1000):
            names.append(name)
            if len(names) >= 500:
                entries.extend(await self._load_batch(names))
                names = []
        if names:
            entries.extend(await self._load_batch(names))
        sinks = list(self._sinks)

        def replace() -> None:
            for sink in sinks:
                sink.replace_all(entries)

        await asyncio.to_thread(replace)
        self._recovered()
        log.info("redis cache store: loaded %d semantic entries", len(entries))
        return last_id

    async def _load_batch(self, names: list[bytes]) -> list[IndexEntry]:
        pipe = self._follower.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, ["s", "c", "t", "v", "x"])
        rows = await pipe.execute()
        out: list[IndexEntry] = []
        for name, row in zip(names, rows, strict=True):
            fields = {k: v for k, v in zip((b"s", b"c", b"t", b"v", b"x"), row, strict=True) if v}
            entry = _entry_from(name.rsplit(b":", 1)[-1].decode(), fields)
            if entry is not None:
                out.append(entry)
        return out

    async def _added(self, messages: Messages) -> dict[str, IndexEntry]:
        """The entries the add events name, read from their hashes: those still there."""
        names = [
            f"{self.prefix}:e:{fields[b'p'].decode()}:{fields[b'i'].decode()}".encode()
            for _message_id, fields in messages
            if fields.get(b"op") == b"add" and b"p" in fields and b"i" in fields
        ]
        if not names:
            return {}
        return {entry.entry_id: entry for entry in await self._load_batch(names)}

    def _apply(self, messages: Messages, added: dict[str, IndexEntry]) -> None:
        for _message_id, fields in messages:
            op = fields.get(b"op")
            for sink in self._sinks:
                if op == b"add":
                    entry = added.get(fields.get(b"i", b"").decode())
                    if entry is not None:
                        sink.add(entry)
                elif op == b"del":
                    sink.remove(fields.get(b"i", b"").decode())
                elif op == b"purge":
                    sink.purge(fields.get(b"p", b"").decode())
            self.events_applied += 1
