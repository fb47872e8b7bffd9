"""Where cache entries live: the ``CacheStore`` interface and the in-memory default.

A store keeps two kinds of entries, both scoped (``CacheScope``) and both with a TTL:

* exact entries: exact key -> response bytes;
* semantic entries: an ``IndexEntry`` (vector, query text, context key) plus response bytes.

Each gateway instance searches its own in-process ``VectorIndex``; the store feeds it through
an ``IndexSink`` (``VectorIndex`` is one): every entry added, evicted or purged anywhere is
announced to the sinks of every instance sharing the store. The in-memory store serves one
instance; ``cache.redis_store.RedisStore`` serves many.

Stores raise ``StoreUnavailable`` when their backend cannot answer in time; the caches turn
that into a miss, never into a failed request.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from cache.index import IndexEntry
from cache.keys import CacheScope, scope_prefix


class StoreUnavailable(Exception):
    """The store's backend did not answer (down, slow, or in its retry back-off)."""


class IndexSink(Protocol):
    def add(self, entry: IndexEntry) -> None: ...

    def remove(self, entry_id: str) -> bool: ...

    def purge(self, scope_prefix: str) -> int: ...

    def replace_all(self, entries: Iterable[IndexEntry]) -> None: ...

    def sweep(self, now: float | None = None) -> int: ...


async def notify(sinks: list[IndexSink], change: Callable[[IndexSink], object]) -> None:
    """Apply an index change in a worker thread: an HNSW insert or rebuild can take a while."""
    if sinks:
        await asyncio.to_thread(lambda: [change(sink) for sink in sinks])


def _remove_all(sink: IndexSink, entry_ids: list[str]) -> None:
    for entry_id in entry_ids:
        sink.remove(entry_id)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    scope: CacheScope
    response: bytes


class CacheStore(Protocol):
    @property
    def available(self) -> bool:
        """False while the backend is known to be down (lookups are skipped)."""
        ...

    def attach(self, sink: IndexSink) -> None:
        """Feed ``sink`` with this store's semantic entries, now and as they change."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def retune(self, *, timeout_s: float, max_bytes: int) -> None:
        """A reload's new ``cache_store`` settings for this same store (its entries stay):
        each store takes what applies to it."""
        ...

    async def get_exact(self, scope: CacheScope, key: str) -> StoredResponse | None: ...

    async def put_exact(self, scope: CacheScope, key: str, response: bytes, ttl_s: int) -> None: ...

    async def get_response(self, scope: CacheScope, entry_id: str) -> StoredResponse | None: ...

    async def put_entry(
        self, entry: IndexEntry, response: bytes, ttl_s: int, max_entries: int
    ) -> None: ...

    async def purge(self, tenant: str, namespace: str | None = None) -> int:
        """Delete every entry of a tenant (or of one of its namespaces); return how many."""
        ...


@dataclass(slots=True)
class _MemEntry:
    scope: CacheScope
    response: bytes
    expires_at: float


class InMemoryStore:
    """One process, no persistence: the default when no Redis is configured.

    ``max_exact_entries`` bounds the exact entries (least recently used go first);
    semantic entries are bounded per scope by the policy's ``max_entries``. ``max_bytes``
    bounds the stored answers of both together (``cache_store.max_memory_bytes``): past it the
    least recently used exact answers go first, then the oldest semantic entries (first stored,
    so first to expire under one TTL), whatever their scope.
    """

    def __init__(self, max_exact_entries: int = 100_000, max_bytes: int = 256 << 20) -> None:
        self._exact: OrderedDict[tuple[CacheScope, str], _MemEntry] = OrderedDict()
        self._entries: dict[str, _MemEntry] = {}  # in the order stored
        self._by_scope: dict[CacheScope, dict[str, float]] = {}
        self._max_exact = max_exact_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._sinks: list[IndexSink] = []

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    @property
    def available(self) -> bool:
        return True

    def attach(self, sink: IndexSink) -> None:
        self._sinks.append(sink)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def retune(self, *, timeout_s: float, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        doomed = self._shed()  # a lower bound holds at once
        if doomed:
            await notify(self._sinks, lambda sink: _remove_all(sink, doomed))

    async def get_exact(self, scope: CacheScope, key: str) -> StoredResponse | None:
        found = self._exact.get((scope, key))
        if found is None:
            return None
        if found.expires_at <= time.time():
            self._pop_exact((scope, key))
            return None
        self._exact.move_to_end((scope, key))
        return StoredResponse(found.scope, found.response)

    async def put_exact(self, scope: CacheScope, key: str, response: bytes, ttl_s: int) -> None:
        if len(response) > self._max_bytes:
            return  # never fits: stored, it would push out everything else
        self._pop_exact((scope, key))
        self._exact[(scope, key)] = _MemEntry(scope, response, time.time() + ttl_s)
        self._bytes += len(response)
        while len(self._exact) > self._max_exact:
            self._pop_exact(next(iter(self._exact)))
        doomed = self._shed()
        if doomed:
            await notify(self._sinks, lambda sink: _remove_all(sink, doomed))

    def _pop_exact(self, key: tuple[CacheScope, str]) -> None:
        found = self._exact.pop(key, None)
        if found is not None:
            self._bytes -= len(found.response)

    def _shed(self) -> list[str]:
        """Past ``max_bytes``: exact answers (least recently used), then semantic entries (the
        oldest); the semantic ids dropped, for the index."""
        doomed: list[str] = []
        while self._bytes > self._max_bytes and self._exact:
            self._pop_exact(next(iter(self._exact)))
        while self._bytes > self._max_bytes and self._entries:
            entry_id = next(iter(self._entries))
            self._forget(entry_id)
            doomed.append(entry_id)
        return doomed

    async def get_response(self, scope: CacheScope, entry_id: str) -> StoredResponse | None:
        found = self._entries.get(entry_id)
        if found is None or found.scope != scope:
            return None
        if found.expires_at <= time.time():
            self._drop(entry_id)
            return None
        return StoredResponse(found.scope, found.response)

    async def put_entry(
        self, entry: IndexEntry, response: bytes, ttl_s: int, max_entries: int
    ) -> None:
        if len(response) > self._max_bytes:
            return
        now = time.time()
        self._forget(entry.entry_id)
        self._entries[entry.entry_id] = _MemEntry(entry.scope, response, entry.expires_at)
        self._bytes += len(response)
        members = self._by_scope.setdefault(entry.scope, {})
        members[entry.entry_id] = entry.expires_at
        doomed = [eid for eid, exp in members.items() if exp <= now]
        if len(members) - len(doomed) > max_entries:
            # The entries closest to expiry go first (the oldest, under one TTL).
            ranked = sorted(members.items(), key=lambda kv: kv[1])
            doomed = [eid for eid, _ in ranked[: len(members) - max_entries]]
        for entry_id in doomed:
            self._forget(entry_id)
        doomed += self._shed()

        def update_index() -> None:
            for sink in self._sinks:
                sink.add(entry)
                for entry_id in doomed:
                    sink.remove(entry_id)

        await asyncio.to_thread(update_index)

    async def purge(self, tenant: str, namespace: str | None = None) -> int:
        prefix = scope_prefix(tenant, namespace)
        removed = 0
        for key in [k for k in self._exact if k[0].path().startswith(prefix)]:
            self._pop_exact(key)
            removed += 1
        for scope in [s for s in self._by_scope if s.path().startswith(prefix)]:
            for entry_id in list(self._by_scope.get(scope, ())):
                self._forget(entry_id)
                removed += 1
            self._by_scope.pop(scope, None)
        await notify(self._sinks, lambda sink: sink.purge(prefix))
        return removed

    def _drop(self, entry_id: str) -> None:
        self._forget(entry_id)
        for sink in self._sinks:
            sink.remove(entry_id)

    def _forget(self, entry_id: str) -> None:
        found = self._entries.pop(entry_id, None)
        if found is not None:
            self._bytes -= len(found.response)
            members = self._by_scope.get(found.scope)
            if members is not None:
                members.pop(entry_id, None)
                if not members:
                    del self._by_scope[found.scope]
