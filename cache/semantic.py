"""Exact and semantic response caches, and the facade the orchestrator calls.

Lookup order (``ResponseCache.lookup``): exact match on the canonical request, then semantic
match of the last user message among entries with the same scope and context key:

1. faiss search of the group for the ``top_k`` nearest stored queries above the cosine floor;
2. the gate (``cache.gate.SemanticGate``): with ``gate=verifier`` the learned verifier scores
   every candidate and the best one at or above its threshold (the calibrated operating point
   for ``max_false_hit_rate``, or ``min_precision`` for statement pairs, or higher where the
   audit tightened it) wins; with
   ``gate=cosine`` the nearest candidate above the threshold wins;
3. the winner's response is read from the store (its scope is checked again there).

Requests whose answer does not generalise (``cache.rules``: tools, the present moment, the
user's own records) are planned exact-only or left out, as the surface's ``rules`` say; a
request whose answer echoes its prompt (``echo``, ``prompt_logprobs``) is exact-only.

The cache never fails a request: store errors and time-outs count as misses (``CacheStats``).
``cache-eval`` runs exactly this code with an in-memory store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cache import rules
from cache.gate import GateVerdict, SemanticGate
from cache.index import IndexEntry, Vector, VectorIndex
from cache.keys import CacheRequest, CacheScope, Endpoint, build_request
from cache.store import CacheStore, StoreUnavailable
from cache.verifier import Verifier
from policies.cache import CachePolicy, SemanticCacheConfig

log = logging.getLogger(__name__)

# A user's text longer than this is cached exactly only. The embedder reads its first 256 tokens
# (about 1,000 characters of English), so a near neighbour says little about the rest; and the
# gate's word alignment, though bounded, costs up to ~0.15 s a candidate on 4,000 characters of
# random tokens, on the search thread every lookup shares.
MAX_SEMANTIC_CHARS = 4000

# The request's embedding when the lookup needs it: awaited only after the exact key missed, so
# an embedding set computing before the lookup runs while the exact key is read.
EmbeddingSource = Callable[[], Awaitable[Vector | None]]


@dataclass(frozen=True, slots=True)
class CacheHit:
    kind: Literal["exact", "semantic"]
    response: bytes  # the stored OpenAI response JSON (replayed by gateway.stages.cache)
    similarity: float | None = None
    verifier_score: float | None = None
    threshold: float | None = None  # the verifier threshold the hit passed
    namespace: str | None = None
    query_text: str | None = None  # the question it was served to (for the audit)
    pair_kind: str | None = None  # which gate accepted it: "request" or "statement"


@dataclass(slots=True)
class CacheStats:
    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    gate_rejections: int = 0  # candidates found above the floor, none accepted
    unavailable: int = 0  # lookups or fills skipped because the store did not answer
    timeouts: int = 0  # lookups cut short by the stage's wait (embedder, search or reads adding up)
    stored: int = 0
    errors: int = 0  # unexpected exceptions (bugs): logged, counted, never raised
    shed: int = 0  # answers not kept: too many fills were waiting for the store or embedder


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What to do for one request: ``request`` is None when the cache is not involved;
    ``semantic`` False: exact matches only; ``rule``: the rule of ``cache.rules`` that
    restricted it."""

    request: CacheRequest | None
    lookup: bool
    fill: bool
    skipped: str | None = None  # why the cache is not involved: temperature, no-cache, no-store
    semantic: bool = True
    rule: str | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit: CacheHit | None
    verdict: GateVerdict | None = None  # None: the semantic gate was not consulted


def entry_id_for(request: CacheRequest) -> str:
    """Same scope, context and query text: same entry (a re-store refreshes it)."""
    digest = hashlib.sha256()
    for part in (request.scope.path(), request.context_key, request.query_text or ""):
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()[:32]


class ExactCache:
    def __init__(self, store: CacheStore) -> None:
        self._store = store

    async def lookup(self, request: CacheRequest) -> CacheHit | None:
        found = await self._store.get_exact(request.scope, request.exact_key)
        if found is None or found.scope != request.scope:
            return None
        return CacheHit("exact", found.response)

    async def store(self, request: CacheRequest, response: bytes, ttl_s: int) -> None:
        await self._store.put_exact(request.scope, request.exact_key, response, ttl_s)


class SemanticCache:
    """Search and gate run on a one-thread executor: faiss and the verifier stay off the loop."""

    def __init__(
        self,
        store: CacheStore,
        index: VectorIndex,
        gate: SemanticGate,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self._store = store
        self.index = index
        self.gate = gate
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="cache-search")

    def find(
        self, request: CacheRequest, embedding: Vector, settings: SemanticCacheConfig
    ) -> GateVerdict:
        """Blocking search + gate."""
        if request.query_text is None:
            return GateVerdict(0)
        candidates = self.index.search(
            request.scope,
            request.context_key,
            embedding,
            k=settings.top_k,
            min_similarity=self.gate.floor(settings),
        )
        return self.gate.choose(request.query_text, candidates, settings, request.scope.namespace)

    def searchable(self, request: CacheRequest) -> bool:
        """A query text, and entries in its group to compare it with."""
        return (
            request.query_text is not None
            and self.index.group_size(request.scope, request.context_key) > 0
        )

    async def lookup(
        self, request: CacheRequest, embedding: Vector, settings: SemanticCacheConfig
    ) -> tuple[CacheHit | None, GateVerdict]:
        if not self.searchable(request):
            return None, GateVerdict(0)
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(
            self._executor, self.find, request, embedding, settings
        )
        winner = verdict.winner
        if winner is None:
            return None, verdict
        found = await self._store.get_response(request.scope, winner.entry_id)
        if found is None or found.scope != request.scope:
            self.index.remove(winner.entry_id)  # expired or evicted meanwhile
            return None, verdict
        hit = CacheHit(
            "semantic",
            found.response,
            winner.similarity,
            verdict.score,
            verdict.threshold,
            request.scope.namespace,
            request.query_text,
            verdict.kind,
        )
        return hit, verdict

    async def store(
        self,
        request: CacheRequest,
        embedding: Vector,
        response: bytes,
        settings: SemanticCacheConfig,
    ) -> None:
        if request.query_text is None:
            return
        entry = IndexEntry(
            entry_id=entry_id_for(request),
            scope=request.scope,
            context_key=request.context_key,
            text=request.query_text,
            vector=np.ascontiguousarray(embedding, dtype=np.float32).reshape(-1),
            expires_at=time.time() + settings.ttl,
        )
        await self._store.put_entry(entry, response, settings.ttl, settings.max_entries)
        if settings.gate == "verifier" and self.gate.verifier is not None:
            # The stored text's tokens, now (a fill runs after its answer was sent) rather
            # than in the first lookup that compares against it.
            await asyncio.to_thread(self.gate.verifier.prepare, entry.text)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _cache_control(header: str | None) -> set[str]:
    if not header:
        return set()
    return {part.strip().lower().split("=", 1)[0] for part in header.split(",") if part.strip()}


class ResponseCache:
    """The orchestrator's entry point: ``plan``, ``lookup``, ``fill``, ``purge``."""

    def __init__(
        self,
        store: CacheStore,
        verifier: Verifier | None,
        *,
        dim: int = 384,
        gate: SemanticGate | None = None,
        stats: CacheStats | None = None,
        **index_args: Any,
    ) -> None:
        """``gate`` and ``stats``: those of the cache this one replaces (a reload that changes
        the store), so the audit's raised thresholds hold and the counters go on."""
        self.store = store
        self.index = VectorIndex(dim, **index_args)
        store.attach(self.index)
        self.exact = ExactCache(store)
        self.semantic = SemanticCache(store, self.index, gate or SemanticGate(verifier))
        self.stats = stats or CacheStats()

    async def start(self) -> None:
        await self.store.start()

    async def aclose(self) -> None:
        await self.store.aclose()
        self.semantic.close()

    def plan(
        self,
        body: Mapping[str, Any],
        policy: CachePolicy | None,
        *,
        tenant: str,
        model_alias: str,
        surface: str,
        endpoint: Endpoint = "chat/completions",
        cache_control: str | None = None,
        query_text: str | None = None,
        continues: bool = False,
    ) -> CachePlan:
        if policy is None or not policy.enabled:
            return CachePlan(None, False, False)
        temperature = body.get("temperature", 1.0)  # absent: the OpenAI default
        if not policy.allow_temperature and (
            not isinstance(temperature, (int, float)) or temperature > 0
        ):
            return CachePlan(None, False, False, "temperature")
        directives = _cache_control(cache_control)
        lookup, fill = "no-cache" not in directives, "no-store" not in directives
        if not (lookup or fill):
            return CachePlan(None, False, False, "no-cache, no-store")
        scope = CacheScope(tenant, model_alias, policy.namespace or surface)
        request = build_request(body, scope, endpoint, query_text, continues)
        mode, rule = rules.mode_for(policy.rules, rules.fired(body, request.query_text))
        if mode == "semantic" and rules.echoes_prompt(body):
            mode, rule = "exact", "echo"
        elif mode == "semantic" and len(request.query_text or "") > MAX_SEMANTIC_CHARS:
            mode, rule = "exact", "long"
        if mode == "off":
            return CachePlan(None, False, False, skipped=f"rule:{rule}", semantic=False, rule=rule)
        return CachePlan(request, lookup, fill, semantic=mode == "semantic", rule=rule)

    async def lookup(
        self, plan: CachePlan, policy: CachePolicy, embedding: Vector | EmbeddingSource | None
    ) -> CacheHit | None:
        """Exact, then semantic (when an embedding of the last user message is given)."""
        return (await self.lookup_detailed(plan, policy, embedding)).hit

    async def lookup_detailed(
        self, plan: CachePlan, policy: CachePolicy, embedding: Vector | EmbeddingSource | None
    ) -> LookupResult:
        """``lookup`` with the semantic gate's verdict (for the request's span)."""
        request = plan.request
        if request is None or not plan.lookup:
            return LookupResult(None)
        verdict: GateVerdict | None = None
        try:
            if not self.store.available:
                self.stats.unavailable += 1
                return LookupResult(None)
            if policy.exact:
                hit = await self.exact.lookup(request)
                if hit is not None:
                    self.stats.exact_hits += 1
                    return LookupResult(hit)
            if (
                plan.semantic
                and policy.semantic is not None
                and embedding is not None
                and self.semantic.searchable(request)
            ):
                # An empty group never waits for the embedding (the fill awaits it later).
                vector = await embedding() if callable(embedding) else embedding
                if vector is None:
                    self.stats.misses += 1
                    return LookupResult(None)
                hit, verdict = await self.semantic.lookup(request, vector, policy.semantic)
                if hit is not None:
                    self.stats.semantic_hits += 1
                    return LookupResult(hit, verdict)
                if verdict.candidates:
                    self.stats.gate_rejections += 1
        except StoreUnavailable:
            self.stats.unavailable += 1
            return LookupResult(None, verdict)
        except Exception:
            self.stats.errors += 1
            log.exception("cache lookup failed; treating it as a miss")
            return LookupResult(None, verdict)
        self.stats.misses += 1
        return LookupResult(None, verdict)

    async def fill(
        self, plan: CachePlan, policy: CachePolicy, response: bytes, embedding: Vector | None
    ) -> None:
        """Store a complete, successful response; run it after the reply, off its path."""
        request = plan.request
        if request is None or not plan.fill:
            return
        try:
            if policy.exact:
                await self.exact.store(request, response, policy.exact_ttl)
            if plan.semantic and policy.semantic is not None and embedding is not None:
                await self.semantic.store(request, embedding, response, policy.semantic)
            self.stats.stored += 1
        except StoreUnavailable:
            self.stats.unavailable += 1
        except Exception:
            self.stats.errors += 1
            log.exception("cache fill failed")

    async def purge(self, tenant: str, namespace: str | None = None) -> int:
        """Admin purge of a tenant (or one namespace); raises ``StoreUnavailable``."""
        return await self.store.purge(tenant, namespace)
