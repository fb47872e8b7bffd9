from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from cache import diff
from cache.lexicon import Lexicon
from cache.semantic import CachePlan, ResponseCache
from cache.store import InMemoryStore
from cache.verifier import Verifier
from gateway.protocol.openai import Endpoint, user_text
from policies.cache import CachePolicy, SemanticCacheConfig
from tests.cache.conftest import HashingEmbedder

COSINE = CachePolicy(semantic=SemanticCacheConfig(gate="cosine", threshold=0.8))


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


def answer(text: str) -> bytes:
    return json.dumps(
        {
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()


def plan_for(
    cache: ResponseCache,
    body: dict[str, Any],
    policy: CachePolicy,
    tenant: str = "t1",
    surface: str = "chat",
    cache_control: str | None = None,
) -> CachePlan:
    return cache.plan(
        body,
        policy,
        tenant=tenant,
        model_alias="m",
        surface=surface,
        cache_control=cache_control,
        query_text=user_text(Endpoint.CHAT, body),
    )


async def put(
    cache: ResponseCache,
    emb: HashingEmbedder,
    policy: CachePolicy,
    q: str,
    a: str,
    tenant: str = "t1",
    surface: str = "chat",
) -> None:
    plan = plan_for(cache, chat(q), policy, tenant, surface)
    await cache.fill(plan, policy, answer(a), (await emb.embed([q]))[0])


async def get(
    cache: ResponseCache,
    emb: HashingEmbedder,
    policy: CachePolicy,
    q: str,
    tenant: str = "t1",
    surface: str = "chat",
) -> Any:
    plan = plan_for(cache, chat(q), policy, tenant, surface)
    return await cache.lookup(plan, policy, (await emb.embed([q]))[0])


async def test_exact_then_semantic_then_miss(embedder: HashingEmbedder) -> None:
    cache = ResponseCache(InMemoryStore(), None)
    await put(cache, embedder, COSINE, "how do I reset my password", "click reset")
    exact = await get(cache, embedder, COSINE, "how do I reset my password")
    assert exact is not None and exact.kind == "exact"
    near = await get(cache, embedder, COSINE, "how do I reset my password please")
    assert near is not None and near.kind == "semantic" and near.similarity > 0.8
    assert json.loads(near.response)["choices"][0]["message"]["content"] == "click reset"
    assert await get(cache, embedder, COSINE, "what is the weather in Paris") is None
    assert (cache.stats.exact_hits, cache.stats.semantic_hits, cache.stats.misses) == (1, 1, 1)
    await cache.aclose()


async def test_temperature_and_cache_control(embedder: HashingEmbedder) -> None:
    cache = ResponseCache(InMemoryStore(), None)
    assert plan_for(cache, chat("q", temperature=0.7), COSINE).request is None
    no_temp = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    assert plan_for(cache, no_temp, COSINE).request is None  # OpenAI default is 1
    warm = COSINE.model_copy(update={"allow_temperature": True})
    assert plan_for(cache, chat("q", temperature=0.7), warm).request is not None
    plan = plan_for(cache, chat("q"), COSINE, cache_control="no-store")
    assert plan.lookup and not plan.fill
    plan = plan_for(cache, chat("q"), COSINE, cache_control="No-Cache, max-age=0")
    assert plan.fill and not plan.lookup
    await cache.fill(
        plan_for(cache, chat("q"), COSINE, cache_control="no-store"),
        COSINE,
        answer("a"),
        None,
    )
    assert await get(cache, embedder, COSINE, "q") is None
    await cache.aclose()


async def test_namespace_from_policy_overrides_surface(embedder: HashingEmbedder) -> None:
    shared = COSINE.model_copy(update={"namespace": "shared"})
    cache = ResponseCache(InMemoryStore(), None)
    await put(cache, embedder, shared, "one question", "one answer", surface="chat")
    assert await get(cache, embedder, shared, "one question", surface="voice") is not None
    assert await get(cache, embedder, COSINE, "one question", surface="voice") is None
    await cache.aclose()


async def test_no_hit_across_tenants_randomized(embedder: HashingEmbedder) -> None:
    """Property: whatever is stored, a lookup only ever returns its own tenant's entries."""
    rng = random.Random(7)
    words = ["reset", "password", "account", "billing", "invoice", "refund", "order", "cancel"]
    tenants = [f"tenant-{i}" for i in range(6)]
    cache = ResponseCache(InMemoryStore(), None)
    loose = CachePolicy(semantic=SemanticCacheConfig(gate="cosine", threshold=0.0))
    stored: dict[str, set[str]] = {t: set() for t in tenants}
    for _ in range(300):
        tenant = rng.choice(tenants)
        question = " ".join(rng.choices(words, k=rng.randint(1, 4)))
        await put(cache, embedder, loose, question, f"{tenant}|{question}", tenant=tenant)
        stored[tenant].add(question)
    hits = 0
    for _ in range(600):
        tenant = rng.choice(tenants)
        question = " ".join(rng.choices(words, k=rng.randint(1, 4)))
        hit = await get(cache, embedder, loose, question, tenant=tenant)
        if hit is None:
            assert not stored[tenant]
            continue
        hits += 1
        owner = json.loads(hit.response)["choices"][0]["message"]["content"].split("|")[0]
        assert owner == tenant
    assert hits > 500  # threshold 0: every tenant with entries gets a hit
    await cache.aclose()


async def test_ttl_and_max_entries_in_memory(
    embedder: HashingEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("cache.store.time.time", lambda: clock[0])
    monkeypatch.setattr("cache.index.time.time", lambda: clock[0])
    monkeypatch.setattr("cache.semantic.time.time", lambda: clock[0])
    policy = CachePolicy(
        exact=False,
        semantic=SemanticCacheConfig(gate="cosine", threshold=0.99, ttl=10, max_entries=2),
    )
    cache = ResponseCache(InMemoryStore(), None)
    for i, q in enumerate(["first question", "second question", "third question"]):
        clock[0] += 1
        await put(cache, embedder, policy, q, f"a{i}")
    assert await get(cache, embedder, policy, "first question") is None  # evicted
    assert await get(cache, embedder, policy, "third question") is not None
    clock[0] += 20
    assert await get(cache, embedder, policy, "third question") is None  # expired
    assert len(cache.index) == 0 or await get(cache, embedder, policy, "second question") is None
    await cache.aclose()


async def test_purge_scope(embedder: HashingEmbedder) -> None:
    cache = ResponseCache(InMemoryStore(), None)
    await put(cache, embedder, COSINE, "question one", "a", tenant="x")
    await put(cache, embedder, COSINE, "question one", "b", tenant="y")
    assert await cache.purge("x") == 2  # exact + semantic entry
    assert await get(cache, embedder, COSINE, "question one", tenant="x") is None
    assert await get(cache, embedder, COSINE, "question one", tenant="y") is not None
    await cache.aclose()


async def test_verifier_gate_rejects_what_cosine_accepts(embedder: HashingEmbedder) -> None:
    verifier = Verifier.load()
    gated = CachePolicy(exact=False, semantic=SemanticCacheConfig(gate="verifier", threshold=0.5))
    cache = ResponseCache(InMemoryStore(), verifier)
    q = "The company reported revenue of 4.5 million dollars in 2003"
    await put(cache, embedder, gated, q, "a")
    # Same words but another number: cosine accepts it, the verifier must not.
    other = "The company reported revenue of 9.1 million dollars in 2003"
    assert await get(cache, embedder, gated, other) is None
    assert cache.stats.gate_rejections == 1
    await cache.aclose()


async def test_a_long_identifier_does_not_hold_the_search_thread(
    embedder: HashingEmbedder,
) -> None:
    """A stored question with a 3,900-letter token and a query with another: the verifier's
    similarity of the two tokens took 5 s and more on the one search thread every lookup of
    the gateway waits on. Now the lookup is a prompt miss."""
    rng = random.Random(1)

    def question() -> str:
        token = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3900))
        return f"What does this identifier mean: {token}"

    gated = CachePolicy(exact=True, semantic=SemanticCacheConfig(gate="verifier", threshold=0.1))
    cache = ResponseCache(InMemoryStore(), Verifier.load())
    await put(cache, embedder, gated, question(), "a")
    started = time.monotonic()
    assert await get(cache, embedder, gated, question()) is None
    assert time.monotonic() - started < 2.0
    assert cache.stats.gate_rejections == 1
    await cache.aclose()


async def test_a_fill_tokenizes_the_stored_text_for_the_gate(embedder: HashingEmbedder) -> None:
    gated = CachePolicy(exact=False, semantic=SemanticCacheConfig(gate="verifier"))
    cache = ResponseCache(InMemoryStore(), Verifier.load())
    q = f"How many moons does planet number {random.randrange(10**9)} have?"
    await put(cache, embedder, gated, q, "a")
    before = diff._shared_tokens.cache_info()
    diff._tokens(q, Lexicon.shared())  # what the first lookup against it reads
    after = diff._shared_tokens.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 0)
    await cache.aclose()


async def test_the_embedding_is_awaited_only_by_a_semantic_search(
    embedder: HashingEmbedder,
) -> None:
    """An exact hit, or a group with nothing to compare with, never waits for the embedding
    (the gateway computes it meanwhile, for the fill and the router)."""
    cache = ResponseCache(InMemoryStore(), None)
    await put(cache, embedder, COSINE, "how do I reset my password", "click reset")
    awaited: list[str] = []

    def source(q: str) -> Any:
        async def vector() -> Any:
            awaited.append(q)
            return (await embedder.embed([q]))[0]

        return vector

    async def lookup(q: str, surface: str = "chat") -> Any:
        plan = plan_for(cache, chat(q), COSINE, surface=surface)
        return await cache.lookup(plan, COSINE, source(q))

    exact = await lookup("how do I reset my password")
    assert exact is not None and exact.kind == "exact" and awaited == []
    assert await lookup("how do I reset my password please", surface="other") is None
    assert awaited == []  # that surface's group is empty
    near = await lookup("how do I reset my password please")
    assert near is not None and near.kind == "semantic"
    assert awaited == ["how do I reset my password please"]

    async def no_vector() -> Any:
        return None

    plan = plan_for(cache, chat("how do I reset my password now"), COSINE)
    assert await cache.lookup(plan, COSINE, no_vector) is None
    assert cache.stats.errors == 0
    await cache.aclose()
