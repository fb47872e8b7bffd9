"""The evaluation behind ``cache-eval`` (``cache/training/cli.py``): the cache's hits on labelled pairs at an operating point, with intervals.

Every pair goes through the gateway's own cache code (``ResponseCache`` over an in-memory
store: exact lookup, index, cosine floor, gate, store read; one namespace per pair), with the
gate's threshold read from the artifact's calibration for ``--max-false-hit-rate``. Reported:

* ``precision`` (correct hits / hits), ``recall`` (correct hits / label-1 pairs) and
  ``false_hit_rate`` (wrong hits / label-0 pairs), each with a 95% Wilson interval;
* ``by_source``: per ``source`` value, ``n`` pairs, ``hits`` and ``rate`` = hits / n (for a
  near-miss kind that is its false-hit rate, for a paraphrase kind its recall), with ``ci95``;
* ``by_gate``: the semantic hits each gate made (``request`` or ``statement`` pairs,
  ``cache.statements``), with their precision;
* ``baselines`` on the same pairs and the same embedding, cosine alone: ``cosine_best`` (the
  lowest threshold meeting the same false-hit bound on these very pairs: tuned in hindsight,
  so flattering), ``redisvl_default`` (RedisVL's distance threshold 0.1, cosine >= 0.9) and
  ``gptcache_default`` (GPTCache's similarity threshold 0.8); the baselines have no rules (the
  products they stand for have none), the gate runs with the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cache.calibration import wilson, wilson_upper
from cache.index import Vector
from cache.training.eval import EvalResult, Tally, evaluate
from cache.training.pairs import Pair
from cache.verifier import Verifier
from policies.cache import CachePolicy, CacheRules, SemanticCacheConfig

NO_RULES = CacheRules(tools="semantic", time="semantic", personal="semantic")
REDISVL_DEFAULT_COSINE = 0.9  # RedisVL SemanticCache distance_threshold=0.1 (cosine distance)
GPTCACHE_DEFAULT_COSINE = 0.8  # GPTCache similarity_threshold=0.8


def _interval(k: int, n: int) -> list[float]:
    low, high = wilson(k, n)
    return [round(low, 4), round(high, 4)]


def summarize(result: EvalResult) -> dict[str, Any]:
    t = result.overall
    negatives = t.pairs - t.positives
    false_hits = t.hits - t.true_hits
    out: dict[str, Any] = {
        "pairs": t.pairs,
        "positives": t.positives,
        "negatives": negatives,
        "hits": t.hits,
        "precision": round(t.true_hits / t.hits, 4) if t.hits else 1.0,
        "recall": round(t.true_hits / t.positives, 4) if t.positives else 0.0,
        "false_hit_rate": round(false_hits / negatives, 4) if negatives else 0.0,
        "ci95": {
            "precision": _interval(t.true_hits, t.hits),
            "recall": _interval(t.true_hits, t.positives),
            "false_hit_rate": _interval(false_hits, negatives),
        },
        "false_hit_rate_upper95": round(wilson_upper(false_hits, negatives), 4),
        "by_source": {k: _source(v) for k, v in sorted(result.by_source.items())},
        "by_gate": {
            k: {
                "hits": v.hits,
                "precision": round(v.true_hits / v.hits, 4) if v.hits else 1.0,
                "ci95": _interval(v.true_hits, v.hits),
            }
            for k, v in sorted(result.by_gate.items())
        },
    }
    return out


def _source(t: Tally) -> dict[str, Any]:
    label: int | None = None
    if t.positives in (0, t.pairs):
        label = 1 if t.positives else 0
    return {
        "n": t.pairs,
        "hits": t.hits,
        "rate": round(t.hits / t.pairs, 4) if t.pairs else 0.0,
        "ci95": _interval(t.hits, t.pairs),
        "label": label,
    }


def best_cosine(cosines: Sequence[float], labels: Sequence[int], bound: float) -> float:
    """Lowest cosine threshold whose false-hit rate upper bound on these pairs is <= bound."""
    negatives = sum(1 for y in labels if y == 0)
    neg = sorted((c for c, y in zip(cosines, labels, strict=True) if y == 0), reverse=True)
    candidates = sorted(set(cosines))
    for t in candidates:
        false_hits = sum(1 for c in neg if c >= t)
        if wilson_upper(false_hits, negatives) <= bound:
            return round(float(t), 4)
    return 1.0


async def evaluate_all(
    pairs: Sequence[Pair],
    emb_a: Vector,
    emb_b: Vector,
    verifier: Verifier,
    policy: CachePolicy,
) -> dict[str, Any]:
    """The gate at the policy's operating point, and the cosine-only baselines."""
    semantic = policy.semantic or SemanticCacheConfig()
    max_false_hit_rate = semantic.max_false_hit_rate
    threshold = verifier.threshold_for(max_false_hit_rate)
    gated = policy.model_copy(update={"semantic": semantic.model_copy(update={"gate": "verifier"})})
    out = summarize(await evaluate(pairs, emb_a, emb_b, gated, verifier))
    out["operating_point"] = {
        "max_false_hit_rate": max_false_hit_rate,
        "threshold": threshold,
        "min_precision": semantic.min_precision,
        "statement_threshold": verifier.threshold_for_statements(semantic.min_precision),
        "cosine_floor": verifier.cosine_floor,
        "vetoes": list(verifier.vetoes),
        "rules": policy.rules.model_dump(),
    }
    cosines = np.einsum("ij,ij->i", emb_a, emb_b).tolist()
    labels = [p.label for p in pairs]
    baselines: dict[str, Any] = {}
    for name, t in (
        ("cosine_best", best_cosine(cosines, labels, max_false_hit_rate)),
        ("redisvl_default", REDISVL_DEFAULT_COSINE),
        ("gptcache_default", GPTCACHE_DEFAULT_COSINE),
    ):
        cosine = SemanticCacheConfig(gate="cosine", threshold=t)
        baseline = CachePolicy(exact=True, semantic=cosine, rules=NO_RULES)
        summary = summarize(await evaluate(pairs, emb_a, emb_b, baseline, None))
        summary["threshold"] = t
        baselines[name] = summary
    out["baselines"] = baselines
    return out


def _line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<22} hits {r['hits']:>5}  precision {r['precision']:.3f}  recall "
        f"{r['recall']:.3f}  false-hit rate {r['false_hit_rate']:.4f} "
        f"(95% CI {r['ci95']['false_hit_rate'][0]:.4f}-{r['ci95']['false_hit_rate'][1]:.4f})"
    )


def render(out: dict[str, Any]) -> str:
    op = out["operating_point"]
    lines = [
        f"gate at max_false_hit_rate {op['max_false_hit_rate']} (threshold {op['threshold']}, "
        f"cosine floor {op['cosine_floor']}), statement pairs at min_precision "
        f"{op['min_precision']} (threshold {op['statement_threshold']})",
        _line("gate", out),
    ]
    for kind, g in out["by_gate"].items():
        lines.append(f"  hits of the {kind} gate: {g['hits']}, precision {g['precision']:.3f}")
    for name, r in out["baselines"].items():
        lines.append(_line(f"{name} (>= {r['threshold']})", r))
    lines.append("by source (rate = hits / n; gate | cosine_best | redisvl | gptcache):")
    base = out["baselines"]
    for source, s in out["by_source"].items():
        cells = [s] + [base[b]["by_source"][source] for b in base]
        rates = " | ".join(f"{c['hits']:>3}/{c['n']:<3} {c['rate']:.3f}" for c in cells)
        lines.append(f"  {source:<20} {rates}")
    return "\n".join(lines)
