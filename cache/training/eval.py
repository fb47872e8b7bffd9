"""Measure the cache's hit quality on labelled pairs, through the server's decision code.

For each pair, text_a is stored as the answer to a one-message request and text_b is then
looked up, with ``ResponseCache`` over an ``InMemoryStore`` (exact, then semantic: index,
floor, gate, store) exactly as the gateway does. Every pair gets its own namespace, so a
lookup can only meet its own text_a.

* precision = correct hits / hits (a hit on a label-1 pair is correct);
* recall = correct hits / label-1 pairs;
* false_hit_rate = wrong hits / label-0 pairs (how often a different question is served
  another question's answer).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cache.index import Vector
from cache.semantic import ResponseCache
from cache.store import InMemoryStore
from cache.training.pairs import Pair
from cache.verifier import Verifier
from policies.cache import CachePolicy, SemanticCacheConfig


@dataclass(slots=True)
class Tally:
    pairs: int = 0
    positives: int = 0
    hits: int = 0
    true_hits: int = 0

    def add(self, label: int, hit: bool) -> None:
        self.pairs += 1
        self.positives += label
        self.hits += int(hit)
        self.true_hits += int(hit and label == 1)

    def summary(self) -> dict[str, float | int]:
        negatives = self.pairs - self.positives
        false_hits = self.hits - self.true_hits
        return {
            "pairs": self.pairs,
            "hits": self.hits,
            "precision": round(self.true_hits / self.hits, 4) if self.hits else 1.0,
            "recall": round(self.true_hits / self.positives, 4) if self.positives else 0.0,
            "false_hit_rate": round(false_hits / negatives, 4) if negatives else 0.0,
        }


@dataclass(slots=True)
class EvalResult:
    overall: Tally = field(default_factory=Tally)
    by_source: dict[str, Tally] = field(default_factory=dict)
    # Semantic hits by the gate that accepted them (request or statement pairs); a Tally of
    # hits only: its precision is the gate's.
    by_gate: dict[str, Tally] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.overall.summary(),
            "by_source": {k: v.summary() for k, v in sorted(self.by_source.items())},
        }


def load_cache_policy(path: Path, surface: str | None = None) -> CachePolicy:
    """A cache section from a YAML file: a bare cache mapping, ``cache:``, or a full policy
    whose ``surfaces`` carry ``cache`` sections (``surface`` picks one; default: the first)."""
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a mapping")
    if "surfaces" in document:
        surfaces = document.get("surfaces") or {}
        names = [surface] if surface else [n for n, s in surfaces.items() if "cache" in (s or {})]
        if not names or names[0] not in surfaces or "cache" not in (surfaces[names[0]] or {}):
            raise ValueError(f"{path}: no surface with a cache section ({surface or 'any'})")
        section = surfaces[names[0]]["cache"]
    else:
        section = document.get("cache", document)
    return CachePolicy.model_validate(section)


def default_policy() -> CachePolicy:
    return CachePolicy(exact=True, semantic=SemanticCacheConfig())


async def evaluate(
    pairs: Sequence[Pair],
    emb_a: Vector,
    emb_b: Vector,
    policy: CachePolicy,
    verifier: Verifier | None,
) -> EvalResult:
    # One namespace per pair: the policy's own namespace would put all pairs in one group.
    policy = policy.model_copy(update={"namespace": None})
    cache = ResponseCache(InMemoryStore(), verifier, dim=int(emb_a.shape[1]))
    result = EvalResult()
    try:
        for i, pair in enumerate(pairs):
            surface = f"pair-{i}"

            def plan_for(text: str, surface: str = surface) -> Any:
                body = {
                    "model": "eval",
                    "temperature": 0,
                    "messages": [{"role": "user", "content": text}],
                }
                return cache.plan(
                    body,
                    policy,
                    tenant="eval",
                    model_alias="eval",
                    surface=surface,
                    query_text=text if text.strip() else None,
                )

            answer = json.dumps({"object": "chat.completion", "choices": [], "pair": i}).encode()
            await cache.fill(plan_for(pair.text_a), policy, answer, emb_a[i])
            hit = await cache.lookup(plan_for(pair.text_b), policy, emb_b[i])
            served = hit is not None and json.loads(hit.response).get("pair") == i
            if hit is not None and not served:
                raise AssertionError(f"pair {i}: served another pair's entry")
            result.overall.add(pair.label, served)
            result.by_source.setdefault(pair.source, Tally()).add(pair.label, served)
            if hit is not None and hit.pair_kind is not None:
                result.by_gate.setdefault(hit.pair_kind, Tally()).add(pair.label, True)
    finally:
        await cache.aclose()
    return result


def run(
    pairs: Sequence[Pair],
    emb_a: Vector,
    emb_b: Vector,
    policy: CachePolicy,
    verifier: Verifier | None,
) -> EvalResult:
    return asyncio.run(evaluate(pairs, emb_a, emb_b, policy, verifier))
