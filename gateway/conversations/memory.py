"""Stored responses in this process: an LRU bounded by count per tenant and by bytes overall.

Records are kept encoded (the bytes are what the bound counts, and a reader gets its own
copy). Expired records are dropped when read and, oldest first, when room is needed.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from gateway.conversations import RecordTooLarge, StoredResponse, StoreLimits, tenant_key


class MemoryResponseStore:
    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self._records: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._per_tenant: dict[str, int] = {}
        self._bytes = 0

    async def put(self, record: StoredResponse) -> None:
        raw = record.encode()
        if len(raw) > self.limits.max_record_bytes:
            raise RecordTooLarge(f"{len(raw)} bytes over {self.limits.max_record_bytes}")
        owner = tenant_key(record.tenant)
        key = (owner, record.id)
        self._drop(key)
        self._records[key] = (time.monotonic() + self.limits.ttl_s, raw)
        self._bytes += len(raw)
        self._per_tenant[owner] = self._per_tenant.get(owner, 0) + 1
        self._evict(owner)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = (tenant_key(tenant), response_id)
        entry = self._records.get(key)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            self._drop(key)
            return None
        self._records.move_to_end(key)
        record = StoredResponse.decode(entry[1])
        return record if record.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = (tenant_key(tenant), response_id)
        entry = self._records.get(key)
        if entry is None or entry[0] <= time.monotonic():
            self._drop(key)
            return False
        self._drop(key)
        return True

    async def aclose(self) -> None:
        self._records.clear()
        self._per_tenant.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._records.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])
            self._per_tenant[key[0]] -= 1

    def _evict(self, owner: str) -> None:
        now = time.monotonic()
        while self._bytes > self.limits.max_total_bytes or (
            self._per_tenant.get(owner, 0) > self.limits.max_entries
        ):
            victim = next(
                (
                    k
                    for k, (expires, _) in self._records.items()
                    if expires <= now or self._bytes > self.limits.max_total_bytes or k[0] == owner
                ),
                None,
            )
            if victim is None:
                return
            self._drop(victim)
