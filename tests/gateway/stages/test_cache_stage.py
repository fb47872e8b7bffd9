"""The cache stage: span attributes (the outcome, the rule, the gate's verdict), what it stores."""

from __future__ import annotations

import asyncio
import json
from typing import cast

from cache.gate import GateVerdict
from cache.index import Candidate
from cache.keys import CacheScope, build_request
from cache.semantic import CacheHit, CachePlan
from gateway.call import Call
from gateway.stages.cache import (
    MAX_PENDING_FILLS,
    MAX_STORED_BYTES,
    CacheStage,
    Lookup,
    StreamCapture,
    storable,
)
from policies.cache import CachePolicy, CacheStoreConfig


def plan(rule: str | None = None, semantic: bool = True, cached: bool = True) -> CachePlan:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    request = build_request(body, CacheScope("t", "m", "ns"), query_text="q") if cached else None
    return CachePlan(request, cached, cached, semantic=semantic, rule=rule)


def test_semantic_hit_carries_the_gates_verdict() -> None:
    winner = Candidate("e", "stored", 0.93)
    verdict = GateVerdict(2, winner, 0.93, 0.97, 0.84, "statement")
    hit = CacheHit("semantic", b"{}", 0.93, 0.97, 0.84, "ns", "q", "statement")
    attrs = Lookup(plan(), hit, verdict).span_attributes()
    assert attrs == {
        "cache": "semantic",
        "cache.gate": "accepted",
        "cache.candidates": 2,
        "cache.similarity": 0.93,
        "cache.verifier_score": 0.97,
        "cache.threshold": 0.84,
        "cache.pair_kind": "statement",
    }


def test_rejections_rules_and_skips() -> None:
    rejected = Lookup(plan(), None, GateVerdict(1, None, 0.97, 0.0, 0.84)).span_attributes()
    assert rejected["cache"] == "miss" and rejected["cache.gate"] == "rejected"
    assert rejected["cache.similarity"] == 0.97 and rejected["cache.verifier_score"] == 0.0
    exact_only = Lookup(plan("time", semantic=False)).span_attributes()
    assert exact_only == {"cache.rule": "time", "cache.mode": "exact", "cache": "miss"}
    off = Lookup(plan("personal", semantic=False, cached=False)).span_attributes()
    assert off == {"cache.rule": "personal", "cache.mode": "off", "cache": "skipped"}
    exact = Lookup(plan(), CacheHit("exact", b"{}")).span_attributes()
    assert exact == {"cache": "exact"}
    assert Lookup(None).span_attributes() == {"cache": "skipped"}


def test_one_size_bound_for_streamed_and_plain_answers() -> None:
    """A non-streamed answer is kept up to the size a stream is kept at, not beyond."""

    def completion(text: str) -> bytes:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return json.dumps({"object": "chat.completion", "choices": [choice]}).encode()

    small = completion("hello")
    assert storable(small)() == small
    assert storable(completion("x" * MAX_STORED_BYTES))() is None
    capture = StreamCapture()
    capture.feed(b"data: " + b"x" * MAX_STORED_BYTES + b"\n\n")
    assert capture.overflow and capture.assembled() is None


def test_the_span_names_the_check_that_refused() -> None:
    candidate = Candidate("e1", "What is the molar mass of CO?", 1.0)
    verdict = GateVerdict(1, None, 1.0, 0.98, 0.88, "request", "case")
    attrs = Lookup(plan(), None, verdict).span_attributes()
    assert attrs["cache.gate"] == "rejected" and attrs["cache.refused_by"] == "case"
    accepted = GateVerdict(1, candidate, 1.0, 0.98, 0.88, "request")
    assert "cache.refused_by" not in Lookup(plan(), None, accepted).span_attributes()


async def test_fills_past_the_pending_bound_are_shed_not_queued() -> None:
    """Each waiting fill holds its answer: with MAX_PENDING_FILLS waiting (a store or an
    embedder behind), a new answer is not kept, and counted, rather than queued without bound."""
    stage = await CacheStage.open(CacheStoreConfig(), None, 8)

    async def waiting() -> None:
        await asyncio.Event().wait()

    blockers = [asyncio.create_task(waiting()) for _ in range(MAX_PENDING_FILLS)]
    stage._tasks.update(blockers)  # fills still waiting
    exact_only = CachePolicy()
    answer = json.dumps({"choices": []}).encode()
    stage.fill_later(cast(Call, None), Lookup(plan(semantic=False)), exact_only, lambda: answer)
    assert stage.cache.stats.shed == 1 and stage.cache.stats.stored == 0
    for blocker in blockers:
        blocker.cancel()
    await asyncio.gather(*blockers, return_exceptions=True)
    stage._tasks.difference_update(blockers)
    stage.fill_later(cast(Call, None), Lookup(plan(semantic=False)), exact_only, lambda: answer)
    await stage.drain()
    assert stage.cache.stats.stored == 1 and stage.cache.stats.shed == 1
    await stage.aclose()
