"""The cache stage of a request: look up before routing, replay a hit, fill after the answer.

The embedding of the request's last user message is computed at most once per request
(``QueryEmbedding``) and shared with the difficulty router. Lookups are bounded by
``cache_store.timeout_ms``: a slow or down store is a miss, never an error. Fills run as
background tasks after the response, off the request's time budget, and only for complete,
successful answers (a stream is stored only when it ended with ``[DONE]`` and every choice
finished).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.protocol.sse import DONE, payloads

if TYPE_CHECKING:
    from cache.embedder import Embedder
    from cache.semantic import CacheHit, CachePlan, ResponseCache
    from policies.cache import CachePolicy, CacheStoreConfig

log = logging.getLogger("llm_gateway.cache")

_MAX_CAPTURE = 4 * 1024 * 1024  # streams longer than this are not cached


@dataclass(slots=True)
class QueryEmbedding:
    """The request's one embedding, computed on first use (off the event loop)."""

    embedder: Embedder | None
    text: str | None
    _vector: Any = None
    _done: bool = False

    async def get(self) -> Any:
        if not self._done:
            self._done = True
            if self.embedder is not None and self.text:
                self._vector = (await self.embedder.embed([self.text]))[0]
        return self._vector


def last_user_text(parsed: ParsedRequest) -> str | None:
    body = parsed.body
    if parsed.endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                return "\n".join(p for p in parts if isinstance(p, str)) or None
            return None
    return None


@dataclass(slots=True)
class StreamCapture:
    """Keeps a stream's bytes (bounded) so a complete answer can be stored afterwards."""

    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    overflow: bool = False

    def feed(self, data: bytes) -> None:
        if self.overflow:
            return
        self.size += len(data)
        if self.size > _MAX_CAPTURE:
            self.overflow = True
            self.chunks.clear()
            return
        self.chunks.append(data)

    def assembled(self) -> bytes | None:
        from cache.replay import assemble_stream, is_storable

        if self.overflow:
            return None
        events: list[dict[str, Any]] = []
        done = False
        for payload in payloads(b"".join(self.chunks)):
            if payload == DONE:
                done = True
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                return None
            if isinstance(obj, dict):
                events.append(obj)
        response = assemble_stream(events, done=done)
        if response is None or not is_storable(response):
            return None
        return json.dumps(response).encode()


class CacheStage:
    def __init__(self, cache: ResponseCache, embedder: Embedder | None, timeout_s: float) -> None:
        self.cache = cache
        self.embedder = embedder
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, config: CacheStoreConfig, needs_embeddings: bool) -> CacheStage:
        """Build the store, index, verifier and (if needed) the embedder, off the event loop."""
        from cache.embedder import SentenceTransformerEmbedder
        from cache.redis_store import RedisStore
        from cache.semantic import ResponseCache
        from cache.store import CacheStore, InMemoryStore
        from cache.verifier import Verifier

        store: CacheStore
        if config.redis_url:
            store = RedisStore(
                config.redis_url, prefix=config.prefix, timeout_s=config.timeout_ms / 1000
            )
        else:
            store = InMemoryStore()
        embedder = None
        if needs_embeddings:
            embedder = await SentenceTransformerEmbedder.create(
                backend=config.embedder_backend, threads=config.embedder_threads
            )
        verifier = await asyncio.to_thread(Verifier.load)
        cache = ResponseCache(store, verifier, dim=embedder.dim if embedder else 384)
        await cache.start()
        return cls(cache, embedder, config.timeout_ms / 1000)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.cache.aclose()
        if self.embedder is not None:
            close = getattr(self.embedder, "aclose", None)
            if close is not None:
                await close()

    def plan(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        policy: CachePolicy | None,
        tenant: str,
        surface: str,
    ) -> CachePlan:
        return self.cache.plan(
            parsed.body,
            policy,
            tenant=tenant,
            model_alias=parsed.model,
            surface=surface,
            endpoint="completions"
            if parsed.endpoint is Endpoint.COMPLETIONS
            else "chat/completions",
            cache_control=request.headers.get("Cache-Control"),
        )

    async def lookup(
        self, plan: CachePlan, policy: CachePolicy, query: QueryEmbedding
    ) -> CacheHit | None:
        if plan.request is None or not plan.lookup:
            return None
        try:
            async with asyncio.timeout(self.timeout_s + 0.5):
                vector = await query.get() if policy.semantic is not None else None
                return await self.cache.lookup(plan, policy, vector)
        except TimeoutError:
            self.cache.stats.unavailable += 1
            return None

    def fill_later(
        self,
        plan: CachePlan,
        policy: CachePolicy,
        answer: Callable[[], bytes | None],
        query: QueryEmbedding,
    ) -> None:
        """Store the answer after the response: ``answer`` returns it, or None if incomplete."""
        if plan.request is None or not plan.fill:
            return

        async def fill() -> None:
            response = answer()
            if response is None:
                return
            vector = await query.get() if policy.semantic is not None else None
            await self.cache.fill(plan, policy, response, vector)

        task = asyncio.create_task(fill())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for pending fills (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def replay(
    request: web.Request, parsed: ParsedRequest, hit: CacheHit, extra: dict[str, str]
) -> web.StreamResponse:
    """Answer from the cache: one JSON body, or SSE chunks when the client streams."""
    from cache.replay import cache_headers, replay_json, replay_sse

    headers = {**extra, **cache_headers(hit)}
    if not parsed.stream:
        return web.Response(
            body=replay_json(hit.response, model=parsed.model),
            content_type="application/json",
            headers=headers,
        )
    opts = parsed.body.get("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    for chunk in replay_sse(hit.response, model=parsed.model, include_usage=include_usage):
        await resp.write(chunk)
    await resp.write_eof()
    return resp


class CacheCollector(Collector):
    """Cache outcomes at scrape time (hits by kind, misses, store unavailable, errors)."""

    def __init__(self, stage: Callable[[], CacheStage | None]) -> None:
        self._stage = stage

    def collect(self) -> Iterator[CounterMetricFamily]:
        stage = self._stage()
        family = CounterMetricFamily(
            "llm_gateway_cache_events", "Semantic cache outcomes", labels=["event"]
        )
        if stage is not None:
            stats = stage.cache.stats
            for name in (
                "exact_hits",
                "semantic_hits",
                "misses",
                "gate_rejections",
                "unavailable",
                "stored",
                "errors",
            ):
                family.add_metric([name], float(getattr(stats, name)))
        yield family
