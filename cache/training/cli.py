"""``llm-gateway cache-eval``: the cache's hits on labelled pairs at an operating point."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from cache.verifier import DEFAULT_ARTIFACT
from policies.cache import CachePolicy, CacheRules, SemanticCacheConfig


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cache-eval",
        help="store text_a, look up text_b of labelled pairs; hits, false hits, intervals",
        description=(
            "Reads a TSV (source, label, text_a, text_b; label 1 = same meaning), stores each "
            "text_a, looks up its text_b through the gateway's own cache code at the operating "
            "point for --max-false-hit-rate and --min-precision (or the policy's semantic "
            "settings), and "
            "prints precision, recall and false-hit rate with 95% Wilson intervals, overall and "
            "per source, next to cosine alone (its best threshold on these pairs, RedisVL's "
            "default 0.9 and GPTCache's 0.8) on the same pairs and the same embedding."
        ),
    )
    p.add_argument("--pairs", required=True, type=Path)
    p.add_argument("--policy", type=Path, help="YAML with the cache section (default: shipped)")
    p.add_argument("--surface", help="which surface's cache section, for a full policy file")
    p.add_argument("--verifier", type=Path, default=DEFAULT_ARTIFACT, help="verifier artifact")
    p.add_argument(
        "--max-false-hit-rate",
        type=float,
        help="the operator's bound (default: the policy's semantic.max_false_hit_rate, 0.01)",
    )
    p.add_argument(
        "--min-precision",
        type=float,
        help="statement pairs' target (default: the policy's semantic.min_precision, 0.98)",
    )
    p.add_argument(
        "--no-rules",
        action="store_true",
        help="judge the gate alone: the no-generalise rules (time, personal, tools) off",
    )
    p.add_argument("--embedding-cache", type=Path, help="where computed embeddings are kept")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_cache_eval)


def _policy(args: argparse.Namespace) -> CachePolicy:
    from cache.training.eval import load_cache_policy

    policy = load_cache_policy(args.policy, args.surface) if args.policy else None
    semantic = (policy.semantic if policy else None) or SemanticCacheConfig()
    for option in ("max_false_hit_rate", "min_precision"):
        if getattr(args, option) is not None:
            semantic = SemanticCacheConfig.model_validate(
                {**semantic.model_dump(), option: getattr(args, option)}
            )
    rules = (policy.rules if policy else None) or CacheRules()
    if args.no_rules:
        from cache.training.gate_eval import NO_RULES

        rules = NO_RULES
    return CachePolicy(exact=True, semantic=semantic, rules=rules)


def _cmd_cache_eval(args: argparse.Namespace) -> int:
    from cache.embedder import SentenceTransformerEmbedder
    from cache.training.gate_eval import evaluate_all, render
    from cache.training.pairs import default_embedding_cache, embed_cached, read_pairs
    from cache.verifier import Verifier

    try:
        pairs = read_pairs(args.pairs)
        policy = _policy(args)
        verifier = Verifier.load(args.verifier)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cache-eval: {exc}", file=sys.stderr)
        return 2
    embedder = SentenceTransformerEmbedder()
    cache_dir = args.embedding_cache or default_embedding_cache()
    emb_a = embed_cached(embedder, [p.text_a for p in pairs], cache_dir)
    emb_b = embed_cached(embedder, [p.text_b for p in pairs], cache_dir)
    out = asyncio.run(evaluate_all(pairs, emb_a, emb_b, verifier, policy))
    print(json.dumps(out) if args.json else render(out))
    return 0
