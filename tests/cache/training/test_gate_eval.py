from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cache.training.cli import add_commands
from cache.training.gate_eval import NO_RULES, best_cosine, evaluate_all
from cache.training.pairs import read_pairs
from cache.verifier import Verifier
from policies.cache import CachePolicy, SemanticCacheConfig
from tests.cache.conftest import HashingEmbedder

TSV = (
    "source\tlabel\ttext_a\ttext_b\n"
    "antonym\t0\tHow do I enable dark mode in VS Code?\tHow do I disable dark mode in VS Code?\n"
    "direction\t0\tConvert YAML to JSON in Python\tConvert JSON to YAML in Python\n"
    "contraction\t1\tWhy isn't my VPN connecting?\tWhy is my VPN not connecting?\n"
    "reorder\t1\tIn Excel, how do I freeze the top row?\tHow do I freeze the top row in Excel?\n"
)


async def test_report_keys_intervals_and_baselines(tmp_path: Path, verifier: Verifier) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text(TSV)
    pairs = read_pairs(path)
    emb = HashingEmbedder()
    a = emb.embed_sync([p.text_a for p in pairs])
    b = emb.embed_sync([p.text_b for p in pairs])
    out = await evaluate_all(pairs, a, b, verifier, CachePolicy(semantic=SemanticCacheConfig()))
    for key in ("precision", "recall", "false_hit_rate", "by_source", "ci95", "baselines"):
        assert key in out
    assert out["false_hit_rate"] == 0.0  # the antonym and the swap are vetoed
    assert out["by_source"]["antonym"] == {
        "n": 1, "hits": 0, "rate": 0.0, "ci95": out["by_source"]["antonym"]["ci95"], "label": 0
    }  # fmt: skip
    low, high = out["ci95"]["false_hit_rate"]
    assert low == 0.0 and 0.5 < high < 1.0
    # Bag-of-words vectors: the swap has cosine 1, every cosine-only gate serves it.
    for name in ("cosine_best", "redisvl_default", "gptcache_default"):
        assert (
            out["baselines"][name]["by_source"]["direction"]["hits"] == 1 or name == "cosine_best"
        )
    assert out["baselines"]["redisvl_default"]["threshold"] == 0.9
    assert out["baselines"]["gptcache_default"]["threshold"] == 0.8
    assert out["operating_point"]["threshold"] == verifier.threshold_for(0.01)
    assert out["operating_point"]["min_precision"] == 0.98
    assert out["operating_point"]["statement_threshold"] == verifier.threshold_for_statements(0.98)
    # The two paraphrases are requests: the request gate served them.
    assert out["by_gate"] == {"request": {"hits": 2, "precision": 1.0, "ci95": [0.3424, 1.0]}}


def test_best_cosine_meets_the_bound_on_the_pairs() -> None:
    cosines = [0.95] * 10 + [0.5] * 990 + [0.97] * 100
    labels = [0] * 1000 + [1] * 100
    # Ten near misses at 0.95: 1% of 1000 is over the bound's upper limit, so above them.
    assert best_cosine(cosines, labels, 0.01) == 0.97
    assert best_cosine(cosines, labels, 0.05) == 0.95


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cache-eval", *argv])
    code: int = args.func(args)
    return code


def test_cli_prints_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text(TSV + "time\t0\tWho won today?\tWho won yesterday?\n")
    emb = str(tmp_path / "emb")
    assert run_cli("--pairs", str(path), "--json", "--embedding-cache", emb) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"precision", "recall", "false_hit_rate", "by_source", "baselines"} <= set(out)
    assert set(out["by_source"]) == {"antonym", "direction", "contraction", "reorder", "time"}
    assert out["operating_point"]["rules"]["time"] == "exact"
    # A bound out of range, a missing file: one line on stderr, exit 2.
    assert run_cli("--pairs", str(path), "--max-false-hit-rate", "2") == 2
    assert run_cli("--pairs", str(tmp_path / "missing.tsv")) == 2
    assert run_cli("--pairs", str(path), "--json", "--no-rules", "--embedding-cache", emb) == 0
    gate_alone = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert gate_alone["operating_point"]["rules"] == NO_RULES.model_dump()
