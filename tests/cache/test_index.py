from __future__ import annotations

import numpy as np

from cache.index import IndexEntry, VectorIndex
from cache.keys import CacheScope, scope_prefix

DIM = 16
A = CacheScope("tenant-a", "m", "ns")
B = CacheScope("tenant-b", "m", "ns")


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    out: np.ndarray = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def entry(i: int, vector: np.ndarray, scope: CacheScope = A, expires: float = 1e12) -> IndexEntry:
    return IndexEntry(f"e{i}", scope, "ctx", f"text {i}", vector, expires)


def test_search_finds_nearest_in_own_group_only() -> None:
    rng = np.random.default_rng(0)
    vecs = unit(rng, 10)
    index = VectorIndex(DIM)
    index.add_many(entry(i, vecs[i]) for i in range(10))
    index.add(IndexEntry("other", B, "ctx", "x", vecs[3], 1e12))
    found = index.search(A, "ctx", vecs[3], k=2, min_similarity=-1)
    assert found[0].entry_id == "e3"
    assert abs(found[0].similarity - 1.0) < 1e-5
    assert all(c.entry_id != "other" for c in index.search(A, "ctx", vecs[3], 20, -1))
    assert index.search(A, "other-context", vecs[3], 2, -1) == []


def test_hnsw_above_the_size_limit_and_tombstone_rebuilds() -> None:
    rng = np.random.default_rng(1)
    vecs = unit(rng, 400)
    index = VectorIndex(DIM, hnsw_min_size=100)
    index.add_many(entry(i, vecs[i]) for i in range(400))
    assert index._groups[(A, "ctx")].hnsw
    for i in range(0, 200):
        assert index.remove(f"e{i}")
    assert len(index) == 200
    group = index._groups[(A, "ctx")]
    assert group.dead < 64 + 100  # rebuilt on the way
    hits = [index.search(A, "ctx", vecs[i], 1, 0.99)[0].entry_id for i in range(200, 400, 7)]
    assert hits == [f"e{i}" for i in range(200, 400, 7)]
    assert index.search(A, "ctx", vecs[5], 3, 0.99) == []


def test_expired_entries_are_not_returned() -> None:
    rng = np.random.default_rng(2)
    v = unit(rng, 1)[0]
    index = VectorIndex(DIM)
    index.add(entry(1, v, expires=100.0))
    assert index.search(A, "ctx", v, 1, 0.5, now=99.0)
    assert index.search(A, "ctx", v, 1, 0.5, now=101.0) == []
    assert "e1" not in index


def test_purge_by_tenant_and_namespace() -> None:
    rng = np.random.default_rng(3)
    v = unit(rng, 3)
    index = VectorIndex(DIM)
    index.add(entry(1, v[0], A))
    index.add(entry(2, v[1], CacheScope("tenant-a", "m", "other-ns")))
    index.add(entry(3, v[2], B))
    assert index.purge(scope_prefix("tenant-a", "ns")) == 1
    assert len(index) == 2
    assert index.purge(scope_prefix("tenant-a")) == 1
    assert list(index._where) == ["e3"]
