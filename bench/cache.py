"""Semantic cache lookup latency with a real redis-server and the real MiniLM embedder.

For each size (default 1e3, 1e4, 1e5 entries in one scope and context, the worst case: one
faiss group, HNSW above 4,096 entries) the store holds ``--real`` entries whose query texts
are text_a of the dev paraphrase pairs (embedded for real) plus random unit vectors as filler.
The queries are the matching text_b, looked up one at a time (concurrency 1) through
``ResponseCache.lookup``, exactly the server's path:

* ``embed``: the embedding alone (the part shared with the difficulty router);
* ``lookup cosine``: embedding (computing while the exact key is read) + faiss search +
  cosine gate + Redis read;
* ``lookup gated``: the same with the learned verifier (the shipped setting), and its cache
  part alone (the embedding given, as the gateway computes it once for cache and router);
* ``miss``: a lookup that cannot hit (empty group): exact get + group check, without the
  embedding, and with it (the lookup does not wait for it, the fill after the answer does);
* ``rps``: lookups per second at concurrency 16 (embedding micro-batched).

    python -m bench.cache [--sizes 1000,10000,100000] [--queries 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench._procs import free_port
from bench.data import data_file, require
from cache.embedder import SentenceTransformerEmbedder
from cache.index import IndexEntry
from cache.keys import CacheScope
from cache.redis_store import RedisStore
from cache.semantic import ResponseCache, entry_id_for
from cache.training.pairs import embed_cached, read_pairs
from cache.verifier import Verifier
from gateway.call import UserQuery
from gateway.protocol.openai import Endpoint, user_text
from policies.cache import CachePolicy, SemanticCacheConfig

DEFAULT_PAIRS = data_file("paraphrase/pairs_dev.tsv")
GATED = CachePolicy(semantic=SemanticCacheConfig(gate="verifier", max_entries=1_000_000))
COSINE = CachePolicy(semantic=SemanticCacheConfig(gate="cosine", max_entries=1_000_000))
ANSWER = json.dumps(
    {
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 400}}],
    }
).encode()


def body(text: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(ms, 0.5), 3), "p99_ms": round(pct(ms, 0.99), 3)}


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> list[float]:
    out = []
    for i in range(n):
        start = time.perf_counter()
        await op(i)
        out.append((time.perf_counter() - start) * 1000)
    return out


async def interleaved(
    n: int, ops: dict[str, Callable[[int], Awaitable[object]]]
) -> dict[str, list[float]]:
    """Time every op once per query, in rotating order: machine noise hits all alike."""
    names = list(ops)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            start = time.perf_counter()
            await ops[name](i)
            out[name].append((time.perf_counter() - start) * 1000)
    return out


class RedisProcess:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found (apt-get install redis-server)")
        self.port = free_port()
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "Ready to accept connections" in line:
                break
        self.proc.stdout.close()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def plan_for(cache: ResponseCache, text: str, policy: CachePolicy, surface: str = "s") -> Any:
    """The plan the gateway would make for a one-message request (its own user-text rule)."""
    request = body(text)
    query = user_text(Endpoint.CHAT, request)
    return cache.plan(
        request, policy, tenant="bench", model_alias="m", surface=surface, query_text=query
    )


async def fill(
    cache: ResponseCache,
    store: RedisStore,
    emb_a: np.ndarray,
    texts: list[str],
    size: int,
    rng: np.random.Generator,
) -> None:
    for text, vec in zip(texts, emb_a, strict=True):
        plan = plan_for(cache, text, GATED)
        await cache.fill(plan, GATED, ANSWER, vec)
    plan = plan_for(cache, "filler", GATED)
    assert plan.request is not None
    scope: CacheScope = plan.request.scope
    context = plan.request.context_key
    filler = size - len(texts)
    batch = 64  # one put per pooled connection at a time
    for start in range(0, filler, batch):
        vecs = rng.standard_normal((min(batch, filler - start), emb_a.shape[1]))
        vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
        entries = []
        for j, v in enumerate(vecs):
            request = plan.request
            eid = entry_id_for(request) + f"-f{start + j}"
            entries.append(IndexEntry(eid, scope, context, f"filler {start + j}", v, 1e12))
        await asyncio.gather(*(store.put_entry(e, ANSWER, 86400, 10**7) for e in entries))


async def run_size(
    size: int,
    queries: int,
    embedder: SentenceTransformerEmbedder,
    verifier: Verifier,
    pairs_a: list[str],
    pairs_b: list[str],
    emb_a: np.ndarray,
) -> dict[str, Any]:
    redis = RedisProcess()
    store = RedisStore(f"redis://127.0.0.1:{redis.port}/0", timeout_s=1.0)
    cache = ResponseCache(store, verifier)
    try:
        await cache.start()
        started = time.perf_counter()
        await fill(cache, store, emb_a, pairs_a, size, np.random.default_rng(size))
        fill_s = time.perf_counter() - started
        qs = pairs_b[:queries]

        async def plan_of(text: str, policy: CachePolicy, surface: str = "s") -> Any:
            return plan_for(cache, text, policy, surface)

        hits = {"gated": 0, "cosine": 0}

        async def lookup(i: int, policy: CachePolicy, name: str, surface: str = "s") -> bool:
            # As gateway.stages.cache does it: the embedding computes while the exact key is read.
            plan = await plan_of(qs[i], policy, surface)
            query = UserQuery(embedder, qs[i])
            query.start()
            hit = await cache.lookup(plan, policy, query.vector) is not None
            hits[name] += hit
            await query.vector()  # the fill's, or the router's (a miss in an empty group)
            return hit

        async def embed_only(i: int) -> None:
            await embedder.embed([qs[i]])

        async def lookup_no_embed(i: int) -> None:
            await cache.lookup(await plan_of(qs[i], GATED), GATED, vectors[i])

        async def miss_no_embed(i: int) -> None:
            plan = await plan_of(qs[i], GATED, surface="empty")
            await cache.lookup(plan, GATED, vectors[i])

        async def miss_with_embed(i: int) -> None:
            plan = await plan_of(qs[i], GATED, surface="empty")
            query = UserQuery(embedder, qs[i])
            query.start()
            await cache.lookup(plan, GATED, query.vector)
            await query.vector()  # the lookup did not wait for it; the fill will

        vectors = embedder.embed_sync(qs)
        await timed(20, embed_only)  # warm-up
        result: dict[str, Any] = {"entries": size, "fill_s": round(fill_s, 1)}
        times = await interleaved(
            len(qs),
            {
                "embed": embed_only,
                "lookup_cosine": lambda i: lookup(i, COSINE, "cosine"),
                "lookup_gated": lambda i: lookup(i, GATED, "gated"),
                "lookup_gated_without_embedding": lookup_no_embed,
                "miss_without_embedding": miss_no_embed,
                "miss_with_embedding": miss_with_embed,
            },
        )
        result.update({name: summary(ms) for name, ms in times.items()})
        result["hits"] = dict(hits)

        async def worker(offset: int, deadline: float, counter: list[int]) -> None:
            i = offset
            while time.perf_counter() < deadline:
                await lookup(i % len(qs), GATED, "gated")
                counter[0] += 1
                i += 16

        counter = [0]
        start = time.perf_counter()
        deadline = start + 5.0
        await asyncio.gather(*(worker(k, deadline, counter) for k in range(16)))
        result["rps_concurrency16"] = round(counter[0] / (time.perf_counter() - start), 1)
        return result
    finally:
        await cache.aclose()
        redis.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    pairs = read_pairs(require(args.pairs))
    positives = [p for p in pairs if p.label == 1][: args.real]
    embedder = await SentenceTransformerEmbedder.create(threads=args.threads)
    verifier = Verifier.load()
    emb_a = embed_cached(embedder, [p.text_a for p in positives])
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "embedder_backend": embedder.backend,
        "embedder_threads": embedder.threads,
        "sizes": [],
    }
    for size in args.sizes:
        res = await run_size(
            size,
            args.queries,
            embedder,
            verifier,
            [p.text_a for p in positives],
            [p.text_b for p in positives],
            emb_a,
        )
        print(json.dumps(res), file=sys.stderr, flush=True)
        out["sizes"].append(res)
    await embedder.aclose()
    return out


def report(out: dict[str, Any]) -> str:
    lines = [
        "| entries | embed p50/p99 | lookup cosine p50/p99 | lookup gated p50/p99 "
        "| cache part of gated (no embed) p50/p99 | miss w/o embed p50/p99 "
        "| miss with embed p50/p99 | lookups/s (c=16) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in out["sizes"]:

        def cell(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]['p50_ms']:.2f} / {r[key]['p99_ms']:.2f}"

        lines.append(
            f"| {r['entries']:,} | {cell('embed')} | {cell('lookup_cosine')} | "
            f"{cell('lookup_gated')} | {cell('lookup_gated_without_embedding')} | "
            f"{cell('miss_without_embedding')} | "
            f"{cell('miss_with_embedding')} | {r['rps_concurrency16']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=[1000, 10000, 100000],
    )
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--real", type=int, default=300, help="entries with real embeddings")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--threads", type=int, default=None, help="embedder threads (default: the gateway's)"
    )
    args = parser.parse_args(argv)
    out = asyncio.run(main_async(args))
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
