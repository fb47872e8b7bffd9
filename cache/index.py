"""In-process vector index of the semantic cache, one group per (scope, context key).

A lookup only ever compares a query with entries of its own group: the same tenant, model
alias and namespace (``CacheScope``) and the same context key (system prompt, earlier turns,
parameters). Groups are keyed by the ``CacheScope`` value itself, not by a digest, so no hash
collision can put two tenants in one group.

Each group is a faiss index over unit vectors with inner product (= cosine):

* ``IndexFlatIP`` (exact search) while the group holds fewer than ``hnsw_min_size`` entries;
* ``IndexHNSWFlat`` (M=``hnsw_m``, efSearch=``hnsw_ef_search``) once it grows past it.

faiss cannot delete from HNSW, so removals leave tombstones (the position's id becomes None);
a group is rebuilt without them once they make up a quarter of it. Expired entries are dropped
when a search meets them. Positions are faiss's sequential ids, so no id map is needed.

All methods take one lock: callers run searches and bulk loads in worker threads (faiss
releases the GIL), and the store's sync task adds entries concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cache.keys import CacheScope

# faiss's loader tries its AVX-512 and AVX2 builds first and logs each miss at INFO with a
# ModuleNotFoundError ("Could not load library..."): noise at every start on a CPU or wheel
# without them. Its outcome is all that matters, and a real failure still raises.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
import faiss  # noqa: E402 (after the logger is quietened)

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    entry_id: str
    scope: CacheScope
    context_key: str
    text: str  # the stored query text: the verifier compares it with the new one
    vector: Vector
    expires_at: float  # unix time


@dataclass(frozen=True, slots=True)
class Candidate:
    entry_id: str
    text: str
    similarity: float


GroupKey = tuple[CacheScope, str]


class _Group:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.index: faiss.Index = faiss.IndexFlatIP(dim)
        self.ids: list[str | None] = []
        self.texts: list[str] = []
        self.expires: list[float] = []
        self.dead = 0
        self.hnsw = False

    @property
    def live(self) -> int:
        return len(self.ids) - self.dead


@dataclass(frozen=True, slots=True)
class _Location:
    key: GroupKey
    position: int


class VectorIndex:
    def __init__(
        self,
        dim: int,
        *,
        hnsw_min_size: int = 4096,
        hnsw_m: int = 32,
        hnsw_ef_search: int = 64,
        hnsw_ef_construction: int = 80,
    ) -> None:
        self.dim = dim
        self.hnsw_min_size = hnsw_min_size
        self._hnsw_m = hnsw_m
        self._ef_search = hnsw_ef_search
        self._ef_construction = hnsw_ef_construction
        self._groups: dict[GroupKey, _Group] = {}
        self._where: dict[str, _Location] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._where

    def group_size(self, scope: CacheScope, context_key: str) -> int:
        group = self._groups.get((scope, context_key))
        return group.live if group is not None else 0

    def add(self, entry: IndexEntry) -> None:
        self.add_many([entry])

    def add_many(self, entries: Iterable[IndexEntry]) -> None:
        by_group: dict[GroupKey, list[IndexEntry]] = {}
        with self._lock:
            for entry in entries:
                if entry.vector.shape != (self.dim,):
                    raise ValueError(f"vector of shape {entry.vector.shape}, want ({self.dim},)")
                if entry.entry_id in self._where:
                    # Re-stored entry: same id, maybe a new response; keep the later expiry.
                    loc = self._where[entry.entry_id]
                    group = self._groups[loc.key]
                    group.expires[loc.position] = max(group.expires[loc.position], entry.expires_at)
                    continue
                by_group.setdefault((entry.scope, entry.context_key), []).append(entry)
            for key, items in by_group.items():
                group = self._groups.get(key) or self._groups.setdefault(key, _Group(self.dim))
                unique = list({e.entry_id: e for e in items}.values())
                start = len(group.ids)
                group.index.add(np.stack([e.vector for e in unique]).astype(np.float32))
                for offset, e in enumerate(unique):
                    group.ids.append(e.entry_id)
                    group.texts.append(e.text)
                    group.expires.append(e.expires_at)
                    self._where[e.entry_id] = _Location(key, start + offset)
                if not group.hnsw and group.live >= self.hnsw_min_size:
                    self._rebuild(key, group)

    def remove(self, entry_id: str) -> bool:
        with self._lock:
            loc = self._where.pop(entry_id, None)
            if loc is None:
                return False
            group = self._groups[loc.key]
            group.ids[loc.position] = None
            group.dead += 1
            if group.live == 0:
                del self._groups[loc.key]
            elif group.dead >= 64 and group.dead * 4 >= len(group.ids):
                self._rebuild(loc.key, group)
            return True

    def sweep(self, now: float | None = None) -> int:
        """Drop every entry past its expiry (a search drops those it meets; this drops the
        rest, in groups no search reaches)."""
        now = time.time() if now is None else now
        with self._lock:
            expired = [
                entry_id
                for group in self._groups.values()
                for entry_id, expires in zip(group.ids, group.expires, strict=True)
                if entry_id is not None and expires <= now
            ]
            for entry_id in expired:
                self.remove(entry_id)
            return len(expired)

    def purge(self, scope_prefix: str) -> int:
        """Drop every group whose ``CacheScope.path()`` starts with ``scope_prefix``."""
        with self._lock:
            doomed = [k for k in self._groups if k[0].path().startswith(scope_prefix)]
            removed = 0
            for key in doomed:
                group = self._groups.pop(key)
                for entry_id in group.ids:
                    if entry_id is not None and self._where.pop(entry_id, None) is not None:
                        removed += 1
            return removed

    def replace_all(self, entries: Iterable[IndexEntry]) -> None:
        """Make the index hold exactly ``entries`` (after a full load from the store)."""
        with self._lock:
            self._groups.clear()
            self._where.clear()
            self.add_many(entries)

    def search(
        self,
        scope: CacheScope,
        context_key: str,
        vector: Vector,
        k: int,
        min_similarity: float,
        now: float | None = None,
    ) -> list[Candidate]:
        """Up to ``k`` live entries of the group at or above ``min_similarity``, best first."""
        key = (scope, context_key)
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)
        now = time.time() if now is None else now
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                return []
            want = min(len(group.ids), k + group.dead + 4)
            scores, positions = group.index.search(query, want)
            found: list[Candidate] = []
            expired: list[str] = []
            for score, pos in zip(scores[0], positions[0], strict=True):
                if pos < 0 or score < min_similarity:
                    continue
                entry_id = group.ids[pos]
                if entry_id is None:
                    continue
                if group.expires[pos] <= now:
                    expired.append(entry_id)
                    continue
                found.append(Candidate(entry_id, group.texts[pos], float(score)))
                if len(found) == k:
                    break
            for entry_id in expired:
                self.remove(entry_id)
            return found

    def _rebuild(self, key: GroupKey, group: _Group) -> None:
        alive = [i for i, entry_id in enumerate(group.ids) if entry_id is not None]
        vectors = (
            group.index.reconstruct_batch(np.asarray(alive, dtype=np.int64))
            if alive
            else np.zeros((0, self.dim), dtype=np.float32)
        )
        fresh = _Group(self.dim)
        if len(alive) >= self.hnsw_min_size:
            hnsw = faiss.IndexHNSWFlat(self.dim, self._hnsw_m, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = self._ef_construction
            hnsw.hnsw.efSearch = self._ef_search
            fresh.index = hnsw
            fresh.hnsw = True
        if alive:
            fresh.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        for new_pos, old_pos in enumerate(alive):
            entry_id = group.ids[old_pos]
            assert entry_id is not None
            fresh.ids.append(entry_id)
            fresh.texts.append(group.texts[old_pos])
            fresh.expires.append(group.expires[old_pos])
            self._where[entry_id] = _Location(key, new_pos)
        self._groups[key] = fresh
