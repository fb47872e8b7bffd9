from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cache.verifier import DEFAULT_ARTIFACT, FEATURE_NAMES, TreeEnsemble, Verifier, pair_features


def test_features_have_the_declared_length_and_catch_mismatches() -> None:
    f = dict(
        zip(
            FEATURE_NAMES,
            pair_features("He paid 5 dollars.", "He paid 7 dollars.", 0.9),
            strict=True,
        )
    )
    assert len(f) == len(FEATURE_NAMES)
    assert f["number_mismatch"] == 1.0
    g = dict(zip(FEATURE_NAMES, pair_features("It is safe.", "It is not safe.", 0.9), strict=True))
    assert g["negation_mismatch"] == 1.0
    h = dict(zip(FEATURE_NAMES, pair_features("Ask Alice now.", "Ask Bob now.", 0.9), strict=True))
    assert h["name_mismatch"] == 1.0
    same = dict(zip(FEATURE_NAMES, pair_features("a b c", "a b c", 1.0), strict=True))
    assert same["word_jaccard"] == 1.0 and same["run_max"] == 0.0


def test_tree_walk_matches_a_hand_built_tree() -> None:
    # One stump: feature 0 <= 0.5 -> -1, else +2; a second tree that is a single leaf of 1.
    ens = TreeEnsemble(
        base_score=0.5,
        learning_rate=0.1,
        depth=1,
        feature=np.array([[0, -1, -1], [-1, -1, -1]]),
        threshold=np.array([[0.5, 0, 0], [0, 0, 0]]),
        left=np.array([[1, 1, 2], [0, 1, 2]]),
        right=np.array([[2, 1, 2], [0, 1, 2]]),
        value=np.array([[0, -1.0, 2.0], [1.0, 0, 0]]),
    )
    out = ens.decision(np.array([[0.2], [0.9]]))
    assert out == pytest.approx([0.5 + 0.1 * (-1 + 1), 0.5 + 0.1 * (2 + 1)])
    assert TreeEnsemble.from_json(json.loads(json.dumps(ens.to_json()))).decision(
        np.array([[0.9]])
    ) == pytest.approx([0.8])


def test_shipped_artifact_is_small_and_consistent() -> None:
    assert DEFAULT_ARTIFACT.stat().st_size < 200_000
    v = Verifier.load()
    assert 0.5 < v.threshold < 1.0
    assert 0.0 < v.cosine_floor < 1.0
    estimate = v.metadata["nested_cv_estimate"]["verifier"]
    assert estimate["precision"] >= 0.97 and estimate["recall"] >= 0.30
    p_same = v.score("How do I reset my password?", "How can I reset my password?", 0.97)
    p_num = v.score("Shares rose 5 percent to $12.40.", "Shares rose 9 percent to $31.10.", 0.97)
    assert p_same > p_num


def test_artifact_with_other_features_is_refused(tmp_path: Path) -> None:
    data = json.loads(DEFAULT_ARTIFACT.read_text())
    data["features"] = data["features"][:-1]
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="features"):
        Verifier.load(path)
