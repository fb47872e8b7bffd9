"""The in-memory store's byte bound (``cache_store.max_memory_bytes``): exact and semantic
answers together, whatever their count; the index forgets what the store sheds."""

from __future__ import annotations

import time

import numpy as np

from cache.index import IndexEntry, VectorIndex
from cache.keys import CacheScope
from cache.store import InMemoryStore

MIB = 1 << 20
A = CacheScope("tenant-a", "m", "ns")
B = CacheScope("tenant-b", "m", "ns")


def _entry(i: int, scope: CacheScope) -> IndexEntry:
    vector = np.zeros(8, dtype=np.float32)
    vector[i % 8] = 1.0
    return IndexEntry(f"e{i}", scope, "ctx", f"text {i}", vector, time.time() + 3600)


async def test_stored_answers_never_pass_the_byte_bound() -> None:
    store = InMemoryStore(max_bytes=4 * MIB)
    index = VectorIndex(8)
    store.attach(index)
    answer = b"x" * MIB
    for i in range(6):  # 6 MiB of exact answers into 4 MiB: the least recently used go
        await store.put_exact(A, f"k{i}", answer, 3600)
        assert store.stored_bytes <= 4 * MIB
    assert await store.get_exact(A, "k0") is None and await store.get_exact(A, "k1") is None
    assert await store.get_exact(A, "k5") is not None
    for i in range(6):  # semantic answers push out the exact ones first, then the oldest
        scope = A if i % 2 else B  # across scopes: the bound is the store's, not a scope's
        await store.put_entry(_entry(i, scope), answer, 3600, max_entries=100)
        assert store.stored_bytes <= 4 * MIB
    assert await store.get_exact(A, "k5") is None
    assert await store.get_response(B, "e0") is None and await store.get_response(A, "e1") is None
    assert await store.get_response(A, "e5") is not None
    assert "e0" not in index and "e1" not in index and "e5" in index
    await store.put_exact(A, "huge", b"y" * (5 * MIB), 3600)  # larger than the whole bound
    assert await store.get_exact(A, "huge") is None and store.stored_bytes <= 4 * MIB
    assert await store.purge("tenant-a") > 0 and await store.purge("tenant-b") > 0
    assert store.stored_bytes == 0


async def test_a_reload_lowering_the_bound_sheds_at_once_and_keeps_the_rest() -> None:
    """A reload that changes ``cache_store`` but keeps the in-memory store retunes it: the
    entries stay, and a lower bound holds at once (the index forgets what was shed)."""
    store = InMemoryStore(max_bytes=4 * MIB)
    index = VectorIndex(8)
    store.attach(index)
    for i in range(4):
        await store.put_entry(_entry(i, A), b"x" * MIB, 3600, max_entries=100)
    await store.retune(timeout_s=0.05, max_bytes=2 * MIB)
    assert store.stored_bytes <= 2 * MIB
    assert "e0" not in index and "e1" not in index
    assert "e3" in index and await store.get_response(A, "e3") is not None
