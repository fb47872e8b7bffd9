"""``llm-gateway cache-eval``: hit precision and recall of the cache on labelled pairs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cache.verifier import DEFAULT_ARTIFACT
from policies.cache import CachePolicy, SemanticCacheConfig


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cache-eval",
        help="store text_a, look up text_b of labelled pairs; print hit precision and recall",
        description=(
            "Reads a TSV (source, label, text_a, text_b; label 1 = same meaning), stores each "
            "text_a, looks up its text_b through the gateway's own cache code, and prints hits, "
            "precision, recall and false-hit rate (wrong hits / label-0 pairs), overall and "
            "per source."
        ),
    )
    p.add_argument("--pairs", required=True, type=Path)
    p.add_argument("--policy", type=Path, help="YAML with the cache section (default: shipped)")
    p.add_argument("--surface", help="which surface's cache section, for a full policy file")
    p.add_argument("--verifier", type=Path, default=DEFAULT_ARTIFACT, help="verifier artifact")
    p.add_argument(
        "--baseline",
        default="",
        help="also run the cosine-only gate at these thresholds, e.g. 0.85,0.9,0.92,0.96",
    )
    p.add_argument("--embedding-cache", type=Path, help="where computed embeddings are kept")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_cache_eval)


def _cmd_cache_eval(args: argparse.Namespace) -> int:
    from cache.embedder import SentenceTransformerEmbedder
    from cache.training.eval import default_policy, load_cache_policy, run
    from cache.training.pairs import embed_cached, read_pairs
    from cache.verifier import Verifier

    try:
        pairs = read_pairs(args.pairs)
        policy = load_cache_policy(args.policy, args.surface) if args.policy else default_policy()
        baselines = [float(t) for t in args.baseline.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        print(f"cache-eval: {exc}", file=sys.stderr)
        return 2
    needs_verifier = policy.semantic is not None and policy.semantic.gate == "verifier"
    verifier = Verifier.load(args.verifier) if needs_verifier else None
    embedder = SentenceTransformerEmbedder()
    emb_a = embed_cached(embedder, [p.text_a for p in pairs], args.embedding_cache)
    emb_b = embed_cached(embedder, [p.text_b for p in pairs], args.embedding_cache)
    result = run(pairs, emb_a, emb_b, policy, verifier).as_dict()
    rows: list[tuple[str, dict[str, object]]] = [(_describe(policy, verifier), result)]
    for threshold in baselines:
        cosine_only = CachePolicy(
            exact=policy.exact,
            semantic=SemanticCacheConfig(gate="cosine", threshold=threshold),
        )
        rows.append(
            (f"cosine >= {threshold}", run(pairs, emb_a, emb_b, cosine_only, None).as_dict())
        )
    if args.json:
        out = dict(result)
        if baselines:
            out["baselines"] = {name: r for name, r in rows[1:]}
        print(json.dumps(out))
        return 0
    for name, r in rows:
        print(f"{name}:")
        print(_line("all", r))
        for source, s in r["by_source"].items():  # type: ignore[attr-defined]
            print(_line(source, s))
    return 0


def _describe(policy: CachePolicy, verifier: object) -> str:
    semantic = policy.semantic
    if semantic is None:
        return "exact only"
    if semantic.gate == "cosine" or verifier is None:
        return f"cosine >= {semantic.threshold}"
    return "shipped gate (cosine floor + verifier)"


def _line(name: str, r: dict[str, object]) -> str:
    return (
        f"  {name:<8} pairs {r['pairs']:>5}  hits {r['hits']:>5}  precision {r['precision']:.3f}"
        f"  recall {r['recall']:.3f}  false-hit rate {r['false_hit_rate']:.3f}"
    )
