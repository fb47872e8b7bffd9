"""Difficulty estimator: features, scoring, tier choice, training, the shipped artifact."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from policies.models import CalibrationTarget, TieredModelConfig
from routing.difficulty import (
    DEFAULT_ARTIFACT,
    HEAD_TARGETS,
    TEXT_FEATURES,
    DifficultyEstimator,
    DifficultyRouter,
    DomainModel,
    LogisticHead,
    head_labels,
    load_estimator,
    read_artifact,
    text_features,
)
from routing.training import train_router
from routing.training.router_data import PromptFilter, load_data
from routing.training.router_eval import figures, score_rows
from routing.training.train_router import fit_domain, fit_logistic, train

DIM = 8


def _head(coef: Sequence[float] | np.ndarray, intercept: float = 0.0) -> LogisticHead:
    return LogisticHead(np.array(coef, dtype=np.float64), intercept)


def _domain(name: str, gate_axis: int, hard_axis: int) -> DomainModel:
    """Small tier fails along ``hard_axis``; the large tier is always right."""
    width = DIM + len(TEXT_FEATURES)
    small = np.zeros(width)
    small[hard_axis] = -6.0
    gate = np.zeros(DIM)
    gate[gate_axis] = 5.0
    return DomainModel(
        name=name,
        gate=_head(gate),
        feature_mean=np.zeros(len(TEXT_FEATURES)),
        feature_scale=np.full(len(TEXT_FEATURES), 1e6),  # text features switched off
        small=_head(small, 3.0),
        large=_head(np.zeros(width), 6.0),
        info={},
    )


def _unit(*pairs: tuple[int, float]) -> np.ndarray:
    v = np.zeros(DIM)
    for axis, value in pairs:
        v[axis] = value
    return v / np.linalg.norm(v)


def test_text_features_count_what_they_name() -> None:
    values = dict(
        zip(TEXT_FEATURES, text_features("How many? 3 + 4 = 7, and 1200 $ at 5%.\nok"), strict=True)
    )
    assert values["log_numbers"] == pytest.approx(np.log1p(5))
    assert values["log_big_numbers"] == pytest.approx(np.log1p(1))
    assert values["log_question_words"] == pytest.approx(np.log1p(1))
    assert values["log_lines"] == pytest.approx(np.log1p(2))
    assert values["has_percent"] == 1.0
    assert values["has_currency"] == 1.0
    assert text_features("").shape == (len(TEXT_FEATURES),)


def test_score_is_the_expected_gain_and_the_gate_picks_the_heads() -> None:
    estimator = DifficultyEstimator(
        [_domain("math", gate_axis=0, hard_axis=2), _domain("trivia", gate_axis=1, hard_axis=3)],
        threshold=0.5,
        dim=DIM,
    )
    hard_math = estimator.score(_unit((0, 1.0), (2, 1.0)), "q")
    assert hard_math.domain == "math"
    assert hard_math.score == pytest.approx(hard_math.p_large - hard_math.p_small)
    assert hard_math.score > 0.5
    # axis 2 is hard only for math: a trivia prompt along it stays easy
    easy_trivia = estimator.score(_unit((1, 1.0), (2, 1.0)), "q")
    assert easy_trivia.domain == "trivia"
    assert easy_trivia.score < 0.1
    with pytest.raises(ValueError, match="columns"):
        estimator.score(np.zeros(DIM + 1), "q")


def test_router_chooses_the_tier_by_threshold() -> None:
    estimator = DifficultyEstimator([_domain("math", 0, 2)], threshold=0.5, dim=DIM)
    hard, easy = _unit((0, 1.0), (2, 1.0)), _unit((0, 1.0))
    router = DifficultyRouter(estimator)
    assert router.decide(hard, "q").tier == "large"
    assert router.decide(easy, "q").tier == "small"
    score = router.decide(easy, "q").score
    assert DifficultyRouter(estimator, threshold=score).decide(easy, "q").tier == "large"
    batch = router.decide_batch(np.vstack([hard, easy]), ["a", "b"])
    assert [d.tier for d in batch] == ["large", "small"]
    assert all(d.threshold == 0.5 for d in batch)


def test_json_round_trip_keeps_the_scores() -> None:
    estimator = DifficultyEstimator(
        [_domain("math", 0, 2), _domain("t", 1, 3)], threshold=0.1, dim=DIM
    )
    again = DifficultyEstimator.from_json(json.loads(json.dumps(estimator.to_json())), DIM)
    rows = np.random.default_rng(0).normal(size=(20, DIM))
    texts = [f"text {i}" for i in range(20)]
    assert again.score_batch(rows, texts) == pytest.approx(
        estimator.score_batch(rows, texts), abs=1e-5
    )


def test_both_head_targets_difference_to_the_gain() -> None:
    small = np.array([0.0, 0.0, 1.0, 1.0])
    large = np.array([0.0, 1.0, 0.0, 1.0])
    for target in HEAD_TARGETS:
        low, high = head_labels(target, small, large)
        assert set(np.unique(low)) <= {0.0, 1.0} and set(np.unique(high)) <= {0.0, 1.0}
        assert (high - low).tolist() == (large - small).tolist()
    assert head_labels("gain_sign", small, large)[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="head target"):
        head_labels("other", small, large)  # type: ignore[arg-type]


def test_gain_sign_heads_rank_by_the_gain_and_survive_json() -> None:
    rng = np.random.default_rng(4)
    n = 400
    x = rng.normal(size=(n, DIM))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    # axis 0: only the large tier is right; axis 1: only the small tier is right
    u = rng.random(n)
    wins = u < 1 / (1 + np.exp(-6 * x[:, 0] + 1))
    losses = ~wins & (u > 1 - 1 / (1 + np.exp(-6 * x[:, 1] + 1)))
    both = rng.random(n) < 0.5
    small = np.where(wins, 0.0, np.where(losses, 1.0, both.astype(float)))
    large = np.where(wins, 1.0, np.where(losses, 0.0, both.astype(float)))
    features = np.zeros((n, len(TEXT_FEATURES)))
    model = fit_domain("m", x, features, small, large, 1.0, 0.1, target="gain_sign")
    assert model.target == "gain_sign" and model.info["target"] == "gain_sign"
    estimator = DifficultyEstimator([model], threshold=0.0, dim=DIM)
    texts = [""] * n
    scores = estimator.score_batch(x, texts)
    gain = large - small
    assert scores[gain > 0].mean() > scores[gain == 0].mean() > scores[gain < 0].mean()
    data = json.loads(json.dumps(estimator.to_json()))
    assert data["domains"][0]["target"] == "gain_sign"
    again = DifficultyEstimator.from_json(data, DIM)
    assert again.domains[0].target == "gain_sign"
    assert again.score_batch(x, texts) == pytest.approx(scores, abs=1e-5)
    del data["domains"][0]["target"]  # artifacts written before the target was recorded
    assert DifficultyEstimator.from_json(data, DIM).domains[0].target == "outcomes"
    data["domains"][0]["target"] = "nonsense"
    with pytest.raises(ValueError, match="head target"):
        DifficultyEstimator.from_json(data, DIM)


def test_fit_logistic_reaches_the_optimum() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 5))
    y = (x @ np.array([2.0, -1.0, 0.0, 0.5, 0.0]) + rng.normal(size=300) > 0).astype(float)
    head = fit_logistic(x, y, c=0.5)
    p = head.probability(x)
    assert np.linalg.norm(x.T @ (p - y) + head.coef / 0.5) < 1e-6  # gradient of the objective
    assert abs(np.sum(p - y)) < 1e-6  # the unpenalised intercept matches the base rate
    assert head.coef[0] > 1.0 and head.coef[1] < -0.5


def _synthetic(path: Path, domain: int, n: int, seed: int) -> dict[str, np.ndarray]:
    """Rows whose embedding says whether the small tier fails; returns prompt -> vector."""
    rng = np.random.default_rng(seed)
    vectors: dict[str, np.ndarray] = {}
    with path.open("w") as out:
        for i in range(n):
            hard = bool(rng.random() < 0.4)
            v = rng.normal(scale=0.3, size=DIM)
            v[domain] += 3.0
            v[4 + domain] += 1.5 if hard else -1.5
            prompt = f"domain {domain} question {i}"
            vectors[prompt] = v / np.linalg.norm(v)
            small = (not hard) if rng.random() < 0.9 else hard
            row = {"prompt": prompt, "small_correct": small, "large_correct": True}
            out.write(json.dumps(row) + "\n")
    return vectors


def test_train_and_evaluate_out_of_fold(tmp_path: Path) -> None:
    vectors = {
        **_synthetic(tmp_path / "alpha.jsonl", 0, 160, 1),
        **_synthetic(tmp_path / "beta.jsonl", 1, 120, 2),
    }

    def embed(texts: Sequence[str]) -> np.ndarray:
        return np.vstack([vectors[t] for t in texts])

    files = [load_data(tmp_path / "alpha.jsonl"), load_data(tmp_path / "beta.jsonl")]
    artifact = train(files, embed, folds=4, repeats=1, seed=3, command="test")
    out = tmp_path / "artifact.json"
    out.write_text(json.dumps(artifact))
    assert artifact["cascade"] is None  # no small_response in the data
    assert [d["sha256"] for d in artifact["training"]["data"]] == [f.sha256 for f in files]
    estimator = load_estimator(out)
    assert [d.name for d in estimator.domains] == ["alpha", "beta"]
    for domain in artifact["route"]["domains"]:
        # the oracle reaches 0.8 here (40 % hard rows), random 0.5
        assert domain["info"]["cv"]["out_of_fold"]["apgr"] > 0.65
    scored = score_rows(read_artifact(out), files[1], embed)
    assert scored.cross_validated
    beta = artifact["route"]["domains"][1]
    assert beta["target"] in HEAD_TARGETS
    # router-eval refits the same heads (target included) on the same folds as training did
    assert figures(scored).apgr == pytest.approx(
        beta["info"]["cv"]["out_of_fold"]["apgr"], abs=1e-4
    )
    assert (estimator.domain_index(embed([r.prompt for r in files[1].rows])) == 1).all()
    again = train(files, embed, folds=4, repeats=1, seed=3, command="test")
    assert json.dumps(again["route"]) == json.dumps(artifact["route"])  # reproducible

    # a file cut from the training data is never scored in-sample: its seen rows are left out
    lines = (tmp_path / "beta.jsonl").read_text().splitlines()
    novel = "a prompt nobody trained on"
    vectors[novel] = vectors["domain 1 question 0"]
    row = json.dumps({"prompt": novel, "small_correct": False, "large_correct": True})
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join([*lines[:30], row]) + "\n")
    partial = score_rows(read_artifact(out), load_data(cut), embed)
    assert not partial.cross_validated
    assert partial.seen_in_training == 30
    assert len(partial.scores) == 1
    cut.write_text("\n".join(lines[:30]) + "\n")
    with pytest.raises(ValueError, match="every row"):
        score_rows(read_artifact(out), load_data(cut), embed)


def test_gain_sign_artifact_is_scored_out_of_fold_with_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vectors = _synthetic(tmp_path / "alpha.jsonl", 0, 160, 1)

    def embed(texts: Sequence[str]) -> np.ndarray:
        return np.vstack([vectors[t] for t in texts])

    files = [load_data(tmp_path / "alpha.jsonl")]
    for target in HEAD_TARGETS:
        monkeypatch.setattr(train_router, "ROUTE_GRID", ((1.0, 0.1, target),))
        artifact = train(files, embed, folds=4, repeats=1, seed=3, command="test")
        domain = artifact["route"]["domains"][0]
        assert domain["target"] == target
        scored = score_rows(artifact, files[0], embed)
        assert figures(scored).apgr == pytest.approx(
            domain["info"]["cv"]["out_of_fold"]["apgr"], abs=1e-4
        )


def test_prompt_filter_knows_the_training_prompts() -> None:
    prompts = [f"question number {i}" for i in range(2000)]
    bloom = PromptFilter.from_json(json.loads(json.dumps(PromptFilter.build(prompts).to_json())))
    assert all(p in bloom for p in prompts)
    assert " question number 7 " in bloom  # surrounding whitespace does not matter
    strangers = sum(f"another question {i}" in bloom for i in range(5000))
    assert strangers <= 25  # 0.1 % false positives expected, 0.5 % tolerated
    assert len(bloom.data) < 2000 * 2


def test_shipped_artifact_is_small_and_documented() -> None:
    assert DEFAULT_ARTIFACT.stat().st_size < 64 * 1024
    artifact = read_artifact()
    training = artifact["training"]
    assert training["command"].startswith("llm-gateway train-router")
    assert {d["name"] for d in training["data"]} == {"gsm8k_dev", "mmlu_dev"}
    estimator = load_estimator()
    rows = np.random.default_rng(0).normal(size=(4, estimator.dim))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    scores = estimator.score_batch(rows, ["a", "b", "c", "d"])
    assert np.all((scores >= -1) & (scores <= 1))
    tight = estimator.threshold_for(CalibrationTarget("max_large_fraction", 0.2))
    loose = estimator.threshold_for(CalibrationTarget("max_large_fraction", 0.6))
    assert tight > loose


def test_shipped_artifact_records_how_to_reproduce_it() -> None:
    """The artifact names each training file by content hash and the command that made it, so
    anyone holding the evaluation data can check it is the same data (docs/data.md)."""
    training = read_artifact()["training"]
    names = [entry["name"] for entry in training["data"]]
    assert names == ["gsm8k_dev", "mmlu_dev"]
    for entry in training["data"]:
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
        assert entry["rows"] > 0
        assert f"{entry['name']}.jsonl" in training["command"]
    assert "llm-gateway train-router" in training["command"] and "--seed 0" in training["command"]


def test_tier_config_validation() -> None:
    config = TieredModelConfig.model_validate(
        {
            "tiers": ["small", {"backend": "gpt", "model": "gpt-4o"}],
            "mode": "cascade",
            "max_large_fraction": 0.3,
            "commit": {"tokens": 32},
        }
    )
    assert config.small.backend == "small" and config.large.model == "gpt-4o"
    assert config.target == CalibrationTarget("max_large_fraction", 0.3)
    assert config.commit_point.tokens == 32
    assert TieredModelConfig.model_validate({"tiers": ["a", "b"]}).commit_point.whole
    bad = [
        {"tiers": ["a", "a"]},
        {"tiers": ["a"]},
        {"tiers": ["a", "b"], "threshold": 0.1, "max_large_fraction": 0.3},
        {"tiers": ["a", "b"], "commit": {"tokens": "whole"}},  # route mode
        {"tiers": ["a", "b"], "mode": "cascade", "commit": {"tokens": 0}},
        {"tiers": ["a", "b"], "min_quality_recovered": 1.2},
        {"tiers": ["a", "b"], "thresold": 0.1},
    ]
    for data in bad:
        with pytest.raises(ValidationError):
            TieredModelConfig.model_validate(data)


def test_tier_config_resolves_the_threshold() -> None:
    estimator = load_estimator()
    plain = TieredModelConfig.model_validate({"tiers": ["a", "b"]})
    assert plain.resolve_threshold(estimator) == estimator.threshold
    fixed = TieredModelConfig.model_validate({"tiers": ["a", "b"], "threshold": 0.25})
    assert fixed.resolve_threshold(estimator) == 0.25
    target = TieredModelConfig.model_validate({"tiers": ["a", "b"], "max_large_fraction": 0.3})
    assert target.resolve_threshold(estimator) == estimator.threshold_for(
        CalibrationTarget("max_large_fraction", 0.3)
    )


def test_nested_cross_validation_runs_the_training_selection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from routing.training.router_cv import main

    vectors = _synthetic(tmp_path / "alpha.jsonl", 0, 120, 1)

    def embed(texts: Sequence[str]) -> np.ndarray:
        return np.vstack([vectors[t] for t in texts])

    argv = ["--data", str(tmp_path / "alpha.jsonl"), "--outer-repeats", "2", "--folds", "3"]
    assert main([*argv, "--repeats", "1", "--targets", "gain_sign"], embed=embed) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["targets"] == ["gain_sign"] and len(result["apgr_per_repeat"]) == 2
    assert result["mean"] > 0.65  # the oracle reaches 0.8 here, random 0.5
