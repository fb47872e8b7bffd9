"""Evaluate tier routing on labelled rows (``llm-gateway router-eval``) and calibrate targets.

Decisions come from the objects the server uses (``DifficultyRouter.decide_batch`` in route mode,
``CascadeVerifier.verdict_batch`` in cascade mode), so the figures describe the shipped code.

Training rows are never scored in-sample. When the data file is one the artifact was trained
on (same SHA-256), it is scored out-of-fold (below). Any other file is checked row by row
against the artifact's Bloom filters of training prompts: rows seen in training are left out
and counted (``seen_in_training``; a false positive drops about one unseen row in a thousand).

Out-of-fold scoring. When the data file is one the artifact was trained on (same SHA-256), an
in-sample score would flatter the router, so each row is scored by a model refitted without it:
the artifact's folds and seed, its chosen hyperparameters, the row's domain heads refitted on
the other folds (other domains untouched: they never saw the file). In cascade mode the
difficulty signal is out-of-fold the same way, and the combiner is refitted on the file's own
answered rows, which is exactly how it was trained when that file is its only source. The
hyperparameters themselves were chosen by cross-validation on the same file: a small optimism
remains from choosing among twelve settings.

The random baseline scores rows with seeded uniform noise and averages its figures over 100
seeds (expected APGR 0.5); at the shipped threshold it sends the same fraction of calls to the
large tier as our router, so its quality there is the straight line between the two tiers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from policies.models import CalibrationTarget
from routing.calibration import wants_large
from routing.cascade import CascadeVerifier, SmallAnswer
from routing.difficulty import DifficultyEstimator, DifficultyRouter
from routing.training.curves import apgr, calibrate, cpt, router_curve
from routing.training.router_data import DataFile, Embed, PromptFilter, labels
from routing.training.train_router import (
    DomainData,
    cascade_design,
    cascade_features,
    fit_cascade,
    stratified_folds,
)

FloatArray = npt.NDArray[np.float64]
Mode = Literal["route", "cascade"]
RANDOM_SEEDS = 100


@dataclass(frozen=True)
class ScoredRows:
    small: FloatArray
    large: FloatArray
    scores: FloatArray
    to_large: npt.NDArray[np.bool_]  # the decision at the threshold (escalations in cascade mode)
    threshold: float
    skipped: int
    cross_validated: bool
    seen_in_training: int = 0


@dataclass(frozen=True)
class RouterFigures:
    apgr: float
    cpt50: float | None
    cpt80: float | None
    large_fraction: float
    quality: float


def training_entry(artifact: dict[str, Any], data: DataFile) -> dict[str, Any] | None:
    for entry in artifact.get("training", {}).get("data", []):
        if entry.get("sha256") == data.sha256:
            return dict(entry)
    return None


def seen_in_training(artifact: dict[str, Any], data: DataFile) -> npt.NDArray[np.bool_]:
    filters = [
        PromptFilter.from_json(entry["prompt_filter"])
        for entry in artifact.get("training", {}).get("data", [])
        if entry.get("prompt_filter")
    ]
    return np.array([any(r.prompt in f for f in filters) for r in data.rows], dtype=bool)


def _route_decisions(
    artifact: dict[str, Any],
    data: DataFile,
    embeddings: FloatArray,
    threshold: float | None,
    entry: dict[str, Any] | None,
) -> tuple[FloatArray, npt.NDArray[np.bool_], float]:
    estimator = DifficultyEstimator.from_json(artifact["route"], int(artifact["embedding"]["dim"]))
    texts = [r.prompt for r in data.rows]
    limit = estimator.threshold if threshold is None else threshold
    n = len(texts)
    scores = np.zeros(n)
    to_large = np.zeros(n, dtype=bool)
    if entry is None:
        parts = [np.arange(n, dtype=np.intp)]
        routers = [DifficultyRouter(estimator, limit)]
    else:
        names = [d.name for d in estimator.domains]
        position = names.index(entry["name"])
        info = estimator.domains[position].info
        domain = DomainData(data, embeddings)
        training = artifact["training"]
        parts = stratified_folds(domain.small, domain.large, training["folds"], training["seed"])
        routers = []
        for test in parts:
            train = np.setdiff1d(np.arange(n), test)
            domains = list(estimator.domains)
            refit = domain.fit(
                train, info["l2_c"], info["text_weight"], estimator.domains[position].target
            )
            domains[position] = replace(refit, gate=estimator.domains[position].gate)
            fold = DifficultyEstimator(domains, threshold=limit, dim=estimator.dim)
            routers.append(DifficultyRouter(fold, limit))
    for test, router in zip(parts, routers, strict=True):
        decisions = router.decide_batch(embeddings[test], [texts[i] for i in test])
        scores[test] = [d.score for d in decisions]
        to_large[test] = [d.tier == "large" for d in decisions]
    return scores, to_large, limit


def score_rows(
    artifact: dict[str, Any],
    data: DataFile,
    embed: Embed,
    mode: Mode = "route",
    threshold: float | None = None,
    cross_validate: bool = True,
) -> ScoredRows:
    entry = training_entry(artifact, data) if cross_validate else None
    seen = 0
    if entry is None and cross_validate:
        known = seen_in_training(artifact, data)
        seen = int(known.sum())
        if seen == len(data.rows):
            raise ValueError(
                f"{data.path}: every row was in the training data; evaluate the whole training "
                "file (scored out-of-fold) or rows the artifact has not seen"
            )
        if seen:
            data = replace(
                data, rows=tuple(r for r, k in zip(data.rows, known, strict=True) if not k)
            )
    embeddings = embed([r.prompt for r in data.rows])
    route_threshold = None if mode == "cascade" else threshold
    difficulty, to_large, limit = _route_decisions(
        artifact, data, embeddings, route_threshold, entry
    )
    if mode == "route":
        small, large = labels(data.rows)
        return ScoredRows(small, large, difficulty, to_large, limit, 0, entry is not None, seen)
    if not artifact.get("cascade"):
        raise ValueError("the artifact has no cascade verifier")
    verifier = CascadeVerifier.from_json(artifact["cascade"])
    limit = verifier.threshold if threshold is None else threshold
    index = np.array(
        [i for i, r in enumerate(data.rows) if r.small_response is not None], dtype=np.intp
    )
    if len(index) == 0:
        raise ValueError(f"{data.path}: no row has a small_response")
    rows = [data.rows[i] for i in index]
    small, large = labels(rows)
    answers = [SmallAnswer(r.small_response or "", r.small_logprobs) for r in rows]
    hardness = difficulty[index]
    if entry is None:
        parts = [np.arange(len(rows), dtype=np.intp)]
        verifiers = [verifier]
    else:
        training = artifact["training"]
        parts = stratified_folds(small, large, training["folds"], training["seed"])
        features = cascade_features(rows)
        if tuple(features) != verifier.features:
            raise ValueError("this file's answers do not carry the verifier's signals")
        raw = cascade_design(rows, hardness, features)
        verifiers = []
        for test in parts:
            train = np.setdiff1d(np.arange(len(rows)), test)
            verifiers.append(
                fit_cascade(raw[train], small[train], large[train], features, verifier.info["l2_c"])
            )
    scores = np.zeros(len(rows))
    escalate = np.zeros(len(rows), dtype=bool)
    for test, fold in zip(parts, verifiers, strict=True):
        verdicts = fold.verdict_batch([answers[i] for i in test], hardness[test], limit)
        scores[test] = [v.score for v in verdicts]
        escalate[test] = [v.escalate for v in verdicts]
    skipped = len(data.rows) - len(rows)
    return ScoredRows(small, large, scores, escalate, limit, skipped, entry is not None, seen)


def figures(scored: ScoredRows) -> RouterFigures:
    curve = router_curve(scored.scores, scored.small, scored.large)
    chosen = np.where(scored.to_large, scored.large, scored.small)
    return RouterFigures(
        apgr=apgr(curve),
        cpt50=cpt(curve, 0.5),
        cpt80=cpt(curve, 0.8),
        large_fraction=float(scored.to_large.mean()),
        quality=float(chosen.mean()),
    )


def random_figures(small: FloatArray, large: FloatArray, large_fraction: float) -> RouterFigures:
    values: list[tuple[float, float | None, float | None]] = []
    for seed in range(RANDOM_SEEDS):
        curve = router_curve(np.random.default_rng(seed).random(len(small)), small, large)
        values.append((apgr(curve), cpt(curve, 0.5), cpt(curve, 0.8)))

    def mean(column: Sequence[float | None]) -> float | None:
        known = [v for v in column if v is not None]
        return float(np.mean(known)) if len(known) == len(column) else None

    return RouterFigures(
        apgr=float(np.mean([v[0] for v in values])),
        cpt50=mean([v[1] for v in values]),
        cpt80=mean([v[2] for v in values]),
        large_fraction=large_fraction,
        quality=float(small.mean() + large_fraction * (large.mean() - small.mean())),
    )


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def evaluation(scored: ScoredRows, mode: Mode, path: str) -> dict[str, Any]:
    ours = figures(scored)
    baseline = random_figures(scored.small, scored.large, ours.large_fraction)
    result: dict[str, Any] = {k: _r(v) for k, v in asdict(ours).items()}
    result.update(
        {
            "data": path,
            "mode": mode,
            "rows": len(scored.small),
            "skipped": scored.skipped,
            "seen_in_training": scored.seen_in_training,
            "threshold": scored.threshold,
            "cross_validated": scored.cross_validated,
            "small_quality": _r(float(scored.small.mean())),
            "large_quality": _r(float(scored.large.mean())),
            "random": {k: _r(v) for k, v in asdict(baseline).items()},
        }
    )
    if mode == "cascade":
        result["escalation_fraction"] = result["large_fraction"]
    return result


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:5.1f}%"


def render(result: dict[str, Any]) -> str:
    how = (
        "out-of-fold (this file trained the artifact)"
        if result["cross_validated"]
        else "scored by the shipped artifact"
    )
    lines = [
        f"router-eval {result['data']}: {result['rows']} rows, {result['mode']} mode, {how}",
        f"small tier quality {result['small_quality']:.3f}, large tier {result['large_quality']:.3f}",
    ]
    if result["mode"] == "cascade":
        lines.append(f"rows without small_response skipped: {result['skipped']}")
    if result["seen_in_training"]:
        lines.append(f"rows left out as seen in training: {result['seen_in_training']}")
    calls = "escalations" if result["mode"] == "cascade" else "large calls"
    lines.append(
        f"{'router':<22}{'APGR':>7}{'CPT(50%)':>10}{'CPT(80%)':>10}{calls:>13}{'quality':>9}"
        f"   at threshold {result['threshold']:.6g}"
    )
    for name, row in (
        ("difficulty" if result["mode"] == "route" else "cascade verifier", result),
        (f"random (mean of {RANDOM_SEEDS})", result["random"]),
    ):
        lines.append(
            f"{name:<22}{row['apgr']:>7.3f}{_pct(row['cpt50']):>10}{_pct(row['cpt80']):>10}"
            f"{_pct(row['large_fraction']):>13}{row['quality']:>9.3f}"
        )
    return "\n".join(lines)


def calibration_result(scored: ScoredRows, target: CalibrationTarget, path: str) -> dict[str, Any]:
    threshold = calibrate(target, scored.scores, scored.small, scored.large)
    to_large = wants_large(scored.scores, threshold)
    chosen = np.where(to_large, scored.large, scored.small)
    gap = float(scored.large.mean() - scored.small.mean())
    quality = float(chosen.mean())
    return {
        "data": path,
        "target": str(target),
        "threshold": threshold,
        "large_fraction": _r(float(to_large.mean())),
        "quality": _r(quality),
        "pgr": _r((quality - float(scored.small.mean())) / gap) if abs(gap) > 1e-12 else None,
        "cross_validated": scored.cross_validated,
        "rows": len(scored.small),
    }


def dumps(result: dict[str, Any]) -> str:
    return json.dumps(result, sort_keys=False)
