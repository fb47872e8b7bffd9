from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from cache.training.cli import add_commands
from cache.training.eval import evaluate, load_cache_policy
from cache.training.pairs import read_pairs
from policies.cache import CachePolicy, SemanticCacheConfig
from tests.cache.conftest import HashingEmbedder

TSV = (
    "source\tlabel\ttext_a\ttext_b\n"
    "s1\t1\thow do I reset my password\thow do I reset my password please\n"
    "s1\t0\twhat is the price of gold\twhat is the price of silver\n"
    "s2\t1\twhere is the nearest station\twhere is the nearest station\n"
    "s2\t0\tbook a flight to rome\tcancel my gym membership\n"
)


async def test_eval_counts_through_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text(TSV)
    pairs = read_pairs(path)
    emb = HashingEmbedder()
    a = emb.embed_sync([p.text_a for p in pairs])
    b = emb.embed_sync([p.text_b for p in pairs])
    cosine = CachePolicy(semantic=SemanticCacheConfig(gate="cosine", threshold=0.6))
    result = (await evaluate(pairs, a, b, cosine, None)).as_dict()
    # Hits: pair 0 (semantic), pair 1 (shares most words: a false hit), pair 2 (exact).
    assert result["hits"] == 3
    assert result["precision"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["recall"] == 1.0
    assert result["false_hit_rate"] == 0.5
    assert result["by_source"]["s2"]["hits"] == 1
    exact_only = (await evaluate(pairs, a, b, CachePolicy(semantic=None), None)).as_dict()
    assert exact_only["hits"] == 1 and exact_only["precision"] == 1.0
    assert np.isclose(a[2] @ b[2], 1.0)


def test_policy_file_forms(tmp_path: Path) -> None:
    bare = tmp_path / "bare.yaml"
    bare.write_text("exact: false\nsemantic: {threshold: 0.9, gate: cosine}\n")
    assert load_cache_policy(bare).semantic == SemanticCacheConfig(threshold=0.9, gate="cosine")
    full = tmp_path / "full.yaml"
    full.write_text("surfaces:\n  chat: {}\n  faq:\n    cache: {exact: true}\n")
    assert load_cache_policy(full).exact
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {exact: true, semantc: {}}\n")
    with pytest.raises(ValueError, match="semantc"):
        load_cache_policy(bad)


def test_cli_registers_cache_eval() -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cache-eval", "--pairs", "x.tsv", "--json"])
    assert args.json and args.pairs == Path("x.tsv") and callable(args.func)
