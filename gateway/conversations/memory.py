"""Stored responses in this process: per tenant an LRU of at most ``max_entries``, and all
tenants together at most ``max_total_bytes``.

Records are kept encoded (the bytes are what the bound counts, and a reader gets its own
copy). Expired records are dropped when read; unread, they are the first an LRU lets go.

Past the byte bound, room is made in the tenant that holds the most bytes (on a tie, the one
whose least recently used record is the oldest), its least recently used record first. So a
tenant storing a lot pushes out its own history, never that of a tenant holding less than it:
each tenant keeps at least an equal share of the bound (``max_total_bytes`` divided by the
tenants holding records) when it uses that much, and any room the others leave. A record
larger than the whole bound is refused (``RecordTooLarge``), as one over ``max_record_bytes`` is.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict

from gateway.conversations import RecordTooLarge, StoredResponse, StoreLimits, tenant_key


class _Entry:
    __slots__ = ("expires", "raw", "used")

    def __init__(self, expires: float, raw: bytes, used: int) -> None:
        self.expires = expires
        self.raw = raw
        self.used = used  # when it was last stored or read (the store's sequence)


class MemoryResponseStore:
    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self._tenants: dict[str, OrderedDict[str, _Entry]] = {}  # by tenant_key, LRU order
        self._tenant_bytes: dict[str, int] = {}
        self._bytes = 0
        self._sequence = itertools.count()

    async def put(self, record: StoredResponse) -> None:
        raw = record.encode()
        bound = min(self.limits.max_record_bytes, self.limits.max_total_bytes)
        if len(raw) > bound:
            raise RecordTooLarge(f"{len(raw)} bytes over {bound}")
        owner = tenant_key(record.tenant)
        self._drop(owner, record.id)
        expires = time.monotonic() + self.limits.ttl_s
        self._tenants.setdefault(owner, OrderedDict())[record.id] = _Entry(
            expires, raw, next(self._sequence)
        )
        self._tenant_bytes[owner] = self._tenant_bytes.get(owner, 0) + len(raw)
        self._bytes += len(raw)
        self._evict(owner)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        owner = tenant_key(tenant)
        records = self._tenants.get(owner)
        entry = records.get(response_id) if records is not None else None
        if records is None or entry is None:
            return None
        if entry.expires <= time.monotonic():
            self._drop(owner, response_id)
            return None
        records.move_to_end(response_id)
        entry.used = next(self._sequence)
        record = StoredResponse.decode(entry.raw)
        return record if record.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        owner = tenant_key(tenant)
        entry = self._drop(owner, response_id)
        return entry is not None and entry.expires > time.monotonic()

    async def aclose(self) -> None:
        self._tenants.clear()
        self._tenant_bytes.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return sum(len(records) for records in self._tenants.values())

    def _drop(self, owner: str, response_id: str) -> _Entry | None:
        records = self._tenants.get(owner)
        entry = records.pop(response_id, None) if records is not None else None
        if records is None or entry is None:
            return None
        self._bytes -= len(entry.raw)
        self._tenant_bytes[owner] -= len(entry.raw)
        if not records:
            del self._tenants[owner], self._tenant_bytes[owner]
        return entry

    def _evict(self, owner: str) -> None:
        records = self._tenants[owner]
        while len(records) > self.limits.max_entries:
            self._drop(owner, next(iter(records)))
        while self._bytes > self.limits.max_total_bytes:
            victim = max(self._tenants, key=self._claim)
            self._drop(victim, next(iter(self._tenants[victim])))

    def _claim(self, owner: str) -> tuple[int, int]:
        """The order in which tenants give up room: the most bytes, then the oldest record."""
        oldest = next(iter(self._tenants[owner].values()))
        return self._tenant_bytes[owner], -oldest.used
