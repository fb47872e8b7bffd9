"""The cache stage: look up before routing, replay a hit, fill after the answer.

Lookups are bounded: each store call by ``cache_store.timeout_ms`` (a slow or down store is
``unavailable``), the whole lookup, embedding and search included, by ``timeout_ms`` + 0.5 s
(``timeouts``: the embedder or search behind, or store reads each under ``timeout_ms`` that
add up past it); either is a miss, never an error. A hit is replayed with a fresh id and timestamp and zero usage (nothing was generated
for this request), as JSON or as the SSE chunks of ``gateway.protocol.answers``. Fills run as
background tasks after the response, off the request's time budget, and only for complete,
successful answers (a stream is stored only when it ended with ``[DONE]`` and every choice
finished) and no longer than ``MAX_STORED_BYTES`` (4 MiB), streamed or not. The cache packages
are imported only when a policy asks for a cache.

The audit (``cache.audit``): a sampled share of semantic hits is asked upstream again, in the
background after the cached answer was sent, as one non-streamed request through the same
attempt machinery (router, retries, fallbacks) without the caller's deadline; the two answers
are compared and the namespace's false-hit estimate updated, and its threshold raised when
the estimate's upper bound exceeds the surface's ``max_false_hit_rate``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.call import Call
from gateway.observability.log_every import LogEvery
from gateway.protocol import upstream_json
from gateway.protocol.answers import assemble, finished, render_json
from gateway.protocol.chat_events import UNREADABLE
from gateway.protocol.openai import Endpoint
from gateway.protocol.sse import DONE, EventSplitter, payloads

if TYPE_CHECKING:
    from cache.audit import AuditBook
    from cache.gate import SemanticGate
    from cache.semantic import CacheHit, CachePlan, CacheStats, ResponseCache
    from gateway.runtime import Destination
    from gateway.upstream.attempts import AttemptOpener
    from policies.cache import CachePolicy, CacheStoreConfig

log = logging.getLogger("llm_gateway.cache")
_unreadable = LogEvery(log)  # one per kind of answer every 10 s

MAX_STORED_BYTES = 4 * 1024 * 1024  # answers longer than this, streamed or not, are not cached
# Fills waiting for the store or the embedder (each holds its answer, up to MAX_STORED_BYTES):
# past this many, a new answer is not kept rather than queued without bound.
MAX_PENDING_FILLS = 256
LOOKUP_MARGIN_S = 0.5  # a lookup waits timeout_ms and this (for the embedding and the search)
ZERO_USAGE: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@dataclass(slots=True)
class StreamCapture:
    """Keeps a stream's events (bounded) so a complete answer can be stored afterwards."""

    events: list[bytes] = field(default_factory=list)
    splitter: EventSplitter = field(default_factory=EventSplitter)
    size: int = 0
    overflow: bool = False

    def feed(self, data: bytes) -> None:
        if self.overflow:
            return
        self.size += len(data)
        if self.size > MAX_STORED_BYTES:
            self.overflow = True
            self.events.clear()
            return
        self.events.extend(self.splitter.feed(data))

    def assembled(self, cut_ok: bool = True) -> bytes | None:
        """The stream as one answer, when it is one ``finished`` would store."""
        if self.overflow:
            return None
        chunks: list[dict[str, Any]] = []
        done = False
        for payload in payloads(b"\n\n".join(self.events)):
            if payload == DONE:
                done = True
                continue
            try:
                obj = upstream_json.loads(payload)
            except ValueError:
                return None
            if isinstance(obj, dict):
                chunks.append(obj)
        answer = assemble(chunks, done=done)
        if answer is None or not finished(answer, cut_ok):
            return None
        return render_json(answer)


def storable(body: bytes | None, cut_ok: bool = True) -> Callable[[], bytes | None]:
    """A non-streamed answer, checked (after the response) to be complete and successful
    (``finished``), and no longer than a stream the cache would keep (``MAX_STORED_BYTES``)."""

    def check() -> bytes | None:
        if body is None or len(body) > MAX_STORED_BYTES:
            return None
        try:
            data = upstream_json.loads(body)
        except ValueError:
            return None
        return body if isinstance(data, dict) and finished(data, cut_ok) else None

    return check


def replayed(hit: CacheHit) -> bytes:
    """The stored answer as a new one: a fresh id, time and tool call ids, zero usage.
    ``model`` stays what the stored answer said (the model that served it), as a live answer
    would say."""
    data = json.loads(hit.response)
    prefix = "chatcmpl" if data.get("object") == "chat.completion" else "cmpl"
    data["id"] = f"{prefix}-cache-{uuid.uuid4().hex[:24]}"
    data["created"] = int(time.time())
    data["usage"] = dict(ZERO_USAGE)
    for choice in data.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and "id" in call:  # an agent indexes results by call id
                call["id"] = f"call_{uuid.uuid4().hex[:24]}"
    return render_json(data)


def cache_headers(hit: CacheHit | None, route_details: bool = False) -> dict[str, str]:
    """A hit's headers: what it was, and where the answer came from (no replica served it);
    with ``route_details`` (``server.route_detail_headers``) the route reason too, as a live
    answer has it."""
    if hit is None:
        return {"x-gateway-cache": "miss"}
    headers: dict[str, str] = {"x-gateway-cache": hit.kind, "x-gateway-replica": "cache"}
    if route_details:
        headers["x-gateway-route-reason"] = f"cache_{hit.kind}"
    if hit.similarity is not None:
        headers["x-gateway-cache-similarity"] = f"{hit.similarity:.4f}"
    return headers


def cache_state(lookup: Lookup) -> dict[str, str]:
    """``x-gateway-cache`` of an answer the cache did not serve: ``miss``, or ``skip`` and why
    (``x-gateway-cache-skip``). Nothing when the surface has no cache."""
    plan = lookup.plan
    if plan is None:
        return {}
    if plan.request is None:
        return {"x-gateway-cache": "skip", "x-gateway-cache-skip": plan.skipped or "uncacheable"}
    if not plan.lookup:
        return {"x-gateway-cache": "skip", "x-gateway-cache-skip": "no-cache"}
    return {"x-gateway-cache": "miss"}


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the cache stage found: ``hit`` ends the request; ``plan`` says whether to fill;
    ``gate``: the semantic gate's verdict, for the span."""

    plan: CachePlan | None
    hit: CacheHit | None = None
    gate: Any = None  # cache.gate.GateVerdict (the cache package loads only with a cache)

    def span_attributes(self) -> dict[str, Any]:
        """``gateway.cache.*`` attributes: the outcome, the rule, the gate's verdict."""
        plan, hit, gate = self.plan, self.hit, self.gate
        attrs: dict[str, Any] = {}
        if plan is not None and plan.rule is not None:
            attrs["cache.rule"] = plan.rule
            attrs["cache.mode"] = "exact" if plan.request is not None else "off"
        if plan is None or plan.request is None:
            attrs["cache"] = "skipped"
            return attrs
        attrs["cache"] = "miss" if hit is None else hit.kind
        if gate is not None and gate.candidates:
            attrs["cache.gate"] = "accepted" if gate.accepted else "rejected"
            attrs["cache.candidates"] = gate.candidates
            attrs["cache.similarity"] = _round(gate.similarity)
            attrs["cache.verifier_score"] = _round(gate.score)
            attrs["cache.threshold"] = _round(gate.threshold)
            attrs["cache.pair_kind"] = gate.kind  # request or statement: whose threshold
            attrs["cache.refused_by"] = gate.refused_by  # a hard check beside the verifier
        elif hit is not None:
            attrs["cache.similarity"] = _round(hit.similarity)
        return {k: v for k, v in attrs.items() if v is not None}

    @property
    def fills(self) -> bool:
        return self.plan is not None and self.plan.request is not None and self.plan.fill


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(frozen=True, slots=True)
class CacheLedger:
    """What the gateway's cache learned and counted, which outlives a stage and its store: the
    gate (with the audit's raised thresholds, which only ``DELETE /admin/cache/thresholds``
    lowers), the counters (which never go back) and the audit book. A reload that replaces
    the store hands it to the new stage; one that turns the cache off keeps it in the runtime
    (``Resources.cache_ledger``) for the next that turns it on."""

    gate: SemanticGate
    stats: CacheStats
    audits: AuditBook


class CacheStage:
    def __init__(
        self,
        cache: ResponseCache,
        config: CacheStoreConfig,
        redis_url: str | None,
        audits: AuditBook | None = None,
    ):
        from cache.audit import AuditBook

        self.cache = cache
        self.config = config  # the settings in force (a reload keeping the store retunes it)
        self.redis_url = redis_url
        self.timeout_s = config.timeout_ms / 1000
        self.audits = audits or AuditBook()
        self._random = random.Random()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(
        cls,
        config: CacheStoreConfig,
        redis_url: str | None,
        dim: int,
        ledger: CacheLedger | None = None,
    ) -> CacheStage:
        """Build the store, index and verifier, off the event loop.

        ``ledger``: that of the stage a reload replaces (its last fills and audits, still
        running, count there too), or of the last stage a reload turned off. The new stage
        goes on with it: the same gate (no verifier to load again), counters and audits."""
        from cache.redis_store import RedisStore
        from cache.semantic import ResponseCache
        from cache.store import CacheStore, InMemoryStore
        from cache.verifier import Verifier

        store: CacheStore
        if redis_url:
            store = RedisStore(redis_url, prefix=config.prefix, timeout_s=config.timeout_ms / 1000)
        else:
            store = InMemoryStore(max_bytes=config.max_memory_bytes)
        if ledger is not None:
            cache = ResponseCache(store, None, dim=dim, gate=ledger.gate, stats=ledger.stats)
        else:
            verifier = await asyncio.to_thread(Verifier.load)
            cache = ResponseCache(store, verifier, dim=dim)
        await cache.start()
        return cls(cache, config, redis_url, ledger.audits if ledger is not None else None)

    @property
    def ledger(self) -> CacheLedger:
        return CacheLedger(self.cache.semantic.gate, self.cache.stats, self.audits)

    def keeps_store(self, config: CacheStoreConfig, redis_url: str | None) -> bool:
        """Whether a reload to these settings keeps this stage and its store (and entries):
        only another Redis, or another key prefix in it, needs a new store."""
        if redis_url != self.redis_url:
            return False
        return redis_url is None or config.prefix == self.config.prefix

    async def retune(self, config: CacheStoreConfig) -> None:
        """Apply a reload's settings to this stage and store (``keeps_store``)."""
        self.config = config
        self.timeout_s = config.timeout_ms / 1000
        await self.cache.store.retune(timeout_s=self.timeout_s, max_bytes=config.max_memory_bytes)

    async def aclose(self) -> None:
        await self.drain()
        await self.cache.aclose()

    def plan(self, call: Call, policy: CachePolicy) -> CachePlan:
        parsed = call.parsed
        return self.cache.plan(
            parsed.body,
            policy,
            tenant=call.tenant,
            model_alias=call.rt.cache_model(parsed.model),
            surface=call.plan.name,
            endpoint="completions"
            if parsed.endpoint is Endpoint.COMPLETIONS
            else "chat/completions",
            cache_control=call.request.headers.get("Cache-Control"),
            query_text=parsed.user_text,
            continues=parsed.continues,
        )

    async def lookup(self, call: Call, policy: CachePolicy) -> Lookup:
        plan = self.plan(call, policy)
        if plan.request is None or not plan.lookup:
            return Lookup(plan)
        try:
            async with asyncio.timeout(self.timeout_s + LOOKUP_MARGIN_S):
                semantic = policy.semantic is not None and plan.semantic
                if semantic:
                    call.query.start()  # computing while the exact key is read
                found = await self.cache.lookup_detailed(
                    plan, policy, call.query.vector if semantic else None
                )
                return Lookup(plan, found.hit, found.verdict)
        except TimeoutError:  # the embedder or search behind, or store reads that add up past it
            self.cache.stats.timeouts += 1
            return Lookup(plan)

    def fill_later(
        self, call: Call, lookup: Lookup, policy: CachePolicy, answer: Callable[[], bytes | None]
    ) -> None:
        """Store the answer after the response: ``answer`` returns it, or None if incomplete."""
        plan = lookup.plan
        if plan is None or not lookup.fills:
            return
        if len(self._tasks) >= MAX_PENDING_FILLS:
            self.cache.stats.shed += 1  # the store or the embedder is behind: not kept
            return

        async def fill() -> None:
            try:
                response = answer()
            except UNREADABLE as exc:  # the readers check shapes; this is the net under them
                kind = type(exc).__name__
                _unreadable.warning(kind, "an answer could not be read for the cache (%s)", kind)
                return
            if response is None:
                return
            vector = await call.query.vector() if policy.semantic is not None else None
            await self.cache.fill(plan, policy, response, vector)

        task = asyncio.create_task(fill())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def audit_later(
        self, call: Call, lookup: Lookup, targets: list[Destination], opener: AttemptOpener
    ) -> None:
        """Ask a sampled semantic hit's question upstream too, after the answer was sent."""
        hit, policy = lookup.hit, call.plan.cache
        if hit is None or hit.kind != "semantic" or policy is None or policy.semantic is None:
            return
        settings = policy.semantic
        if settings.gate != "verifier":
            return  # the audit measures (and tightens) the learned gate
        if settings.audit_fraction <= 0 or self._random.random() >= settings.audit_fraction:
            return
        if not self.audits.take(settings.audit_per_minute, time.monotonic()):
            return
        from gateway.stages.audit import audit

        work = audit(self.cache, self.audits, call, hit, settings, targets, opener)
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def report(self) -> dict[str, Any]:
        """What ``GET /admin/cache`` shows: outcomes, audits, thresholds per namespace."""
        stats = self.cache.stats
        return {
            "stats": {name: getattr(stats, name) for name in _STATS},
            "audit": self.audits.summary(),
            "tightened_thresholds": self.cache.semantic.gate.tightened(),
        }

    async def drain(self) -> None:
        """Wait for pending fills (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


_STATS = (
    "exact_hits",
    "semantic_hits",
    "misses",
    "gate_rejections",
    "unavailable",
    "timeouts",
    "stored",
    "errors",
    "shed",
)


class CacheCollector(Collector):
    """Cache outcomes at scrape time (hits by kind, misses, store unavailable, lookups timed
    out, errors)."""

    def __init__(self, stage: Callable[[], CacheStage | None]) -> None:
        self._stage = stage

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stage = self._stage()
        family = CounterMetricFamily(
            "llm_gateway_cache_events", "Semantic cache outcomes", labels=["event"]
        )
        audits = CounterMetricFamily(
            "llm_gateway_cache_audits",
            "Semantic hits audited upstream, by namespace and outcome",
            labels=["namespace", "outcome"],
        )
        cost = CounterMetricFamily(
            "llm_gateway_cache_audit_requests",
            "Audit requests sent upstream, skipped over audit_per_minute, failed",
            labels=["event"],
        )
        tokens = CounterMetricFamily(
            "llm_gateway_cache_audit_tokens", "Upstream tokens the audits cost"
        )
        upper = GaugeMetricFamily(
            "llm_gateway_cache_false_hit_upper",
            "One-sided 95% upper bound of the audited false-hit rate, per namespace",
            labels=["namespace"],
        )
        threshold = GaugeMetricFamily(
            "llm_gateway_cache_gate_threshold",
            "Verifier threshold in force at the last audited hit, per namespace",
            labels=["namespace"],
        )
        if stage is not None:
            stats = stage.cache.stats
            for name in _STATS:
                family.add_metric([name], float(getattr(stats, name)))
            book = stage.audits
            for namespace, state in book.namespaces.items():
                agreed = state.audited - state.false_hits
                audits.add_metric([namespace, "same_answer"], float(agreed))
                audits.add_metric([namespace, "false_hit"], float(state.false_hits))
                summary = state.summary()
                upper.add_metric([namespace], float(summary["upper95"]))
                if state.threshold is not None:
                    threshold.add_metric([namespace], state.threshold)
            cost.add_metric(["sent"], float(book.sent))
            cost.add_metric(["skipped"], float(book.skipped))
            cost.add_metric(["failed"], float(book.failed))
            tokens.add_metric([], float(book.tokens))
        yield family
        yield audits
        yield cost
        yield tokens
        yield upper
        yield threshold
