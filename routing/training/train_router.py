"""Train the difficulty estimator and the cascade verifier (``llm-gateway train-router``).

Data: JSONL rows with ``prompt``, ``small_correct``, ``large_correct`` and optionally
``small_response`` (and ``small_logprobs``, a list of token logprobs). Each file is one domain.

Procedure, deterministic for a given seed:

1. Embed every prompt with the gateway's embedder (all-MiniLM-L6-v2); vectors are cached on disk
   (outside the repository) keyed by the texts, so repeated runs cost no model time.
2. Per domain, choose the L2 strength ``c``, the weight of the text features and the heads'
   target (``outcomes`` or ``gain_sign``, see ``routing.difficulty``) by repeated stratified
   k-fold cross-validation inside that file (strata: the four small/large outcomes), maximising
   APGR of the out-of-fold scores; then fit both heads on the whole file.
3. Out-of-fold difficulty scores (first repeat, chosen settings, scored through the full
   estimator with its domain gate) give the calibration table and the shipped threshold.
4. Rows with a ``small_response`` train the cascade combiner the same way, with the out-of-fold
   difficulty score as one of its signals (an in-sample score would look too reliable).

Logistic regressions are fitted by Newton's method (exact, no solver randomness).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.models import CalibrationTarget
from routing.cascade import (
    CASCADE_FEATURES,
    LOGPROB_FEATURES,
    CascadeVerifier,
    SmallAnswer,
    answer_signals,
)
from routing.difficulty import (
    ARTIFACT_FORMAT,
    EMBEDDING_MODEL,
    HEAD_TARGETS,
    TEXT_FEATURES,
    DifficultyEstimator,
    DomainModel,
    HeadTarget,
    LogisticHead,
    head_labels,
    text_feature_matrix,
)
from routing.training.curves import apgr, calibrate, cpt, router_curve, table_from_scores
from routing.training.router_data import DataFile, Embed, LabelledRow, PromptFilter, labels

FloatArray = npt.NDArray[np.float64]

ROUTE_GRID: tuple[tuple[float, float, HeadTarget], ...] = tuple(
    (c, w, t) for t in HEAD_TARGETS for c in (0.1, 0.3, 1.0) for w in (0.1, 0.3)
)  # (l2 c, text-feature weight, heads' target); ties go to the earlier setting
CASCADE_GRID: tuple[float, ...] = (0.1, 1.0, 10.0)
DEFAULT_TARGET = CalibrationTarget("min_quality_recovered", 0.8)
GATE_C = 10.0


def fit_logistic(
    x: FloatArray,
    y: FloatArray,
    c: float,
    max_iter: int = 50,
    weights: FloatArray | None = None,
) -> LogisticHead:
    """L2-regularised logistic regression, weighted log-loss + ||w||^2 / (2c), by Newton."""
    n, d = x.shape
    sample = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    design = np.hstack([x, np.ones((n, 1))])
    penalty = np.full(d + 1, 1.0 / c)
    penalty[-1] = 1e-8  # the intercept is not shrunk
    w = np.zeros(d + 1)
    mean = float(np.clip(np.average(y, weights=sample), 1e-3, 1 - 1e-3))
    w[-1] = np.log(mean / (1 - mean))

    def objective(v: FloatArray) -> float:
        z = design @ v
        loss = sample * (np.logaddexp(0.0, z) - y * z)
        return float(np.sum(loss) + 0.5 * np.sum(penalty * v * v))

    current = objective(w)
    for _ in range(max_iter):
        z = design @ w
        p = 0.5 * (1.0 + np.tanh(0.5 * z))
        gradient = design.T @ (sample * (p - y)) + penalty * w
        hessian = (design * (sample * p * (1 - p))[:, None]).T @ design + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        scale = 1.0
        while scale > 1e-4:
            candidate = w - scale * step
            value = objective(candidate)
            if value <= current + 1e-12:
                break
            scale *= 0.5
        w, current = candidate, value
        if float(np.max(np.abs(scale * step))) < 1e-7:
            break
    return LogisticHead(coef=w[:-1].copy(), intercept=float(w[-1]))


def stratified_folds(
    small: FloatArray, large: FloatArray, k: int, seed: int
) -> list[npt.NDArray[np.intp]]:
    """k test-index arrays; each small/large outcome is spread evenly over the folds."""
    rng = np.random.default_rng(seed)
    strata = (2 * small + large).astype(int)
    folds: list[list[int]] = [[] for _ in range(k)]
    offset = 0
    for stratum in range(4):
        members = np.nonzero(strata == stratum)[0]
        rng.shuffle(members)
        for j, index in enumerate(members):
            folds[(offset + j) % k].append(int(index))
        offset += len(members)
    return [np.array(sorted(f), dtype=np.intp) for f in folds]


def fit_domain(
    name: str,
    embeddings: FloatArray,
    features: FloatArray,
    small: FloatArray,
    large: FloatArray,
    c: float,
    text_weight: float,
    info: dict[str, Any] | None = None,
    target: HeadTarget = "outcomes",
) -> DomainModel:
    """Both heads of one domain; ``features`` are the raw ``text_feature_matrix`` rows."""
    mean = features.mean(axis=0)
    scale = features.std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    x = np.hstack([embeddings, text_weight * (features - mean) / scale])
    heads = []
    for y in head_labels(target, small, large):
        head = fit_logistic(x, y, c)
        coef = head.coef.copy()
        coef[embeddings.shape[1] :] *= text_weight  # fold the weight into the coefficients
        heads.append(LogisticHead(coef, head.intercept))
    info = {"l2_c": c, "text_weight": text_weight, "target": target, **(info or {})}
    no_gate = LogisticHead(np.zeros(embeddings.shape[1]), 0.0)  # set by ``with_gates``
    return DomainModel(name, no_gate, mean, scale, heads[0], heads[1], info, target)


def with_gates(
    models: Sequence[DomainModel], embeddings: Sequence[FloatArray], c: float = GATE_C
) -> list[DomainModel]:
    """Give each domain its one-vs-rest gate, fitted on the prompts of every domain.

    Classes are balanced: a small domain's prompts sent to a big domain's heads cost the small
    domain much more than the reverse (cross-validated on GSM8K + MMLU: 0.648 APGR on GSM8K
    with balanced weights, 0.615 without at c = 1; MMLU unchanged at 0.685).
    """
    if len(models) == 1:
        return list(models)
    everything = np.vstack(embeddings)
    owner = np.concatenate([np.full(len(e), i) for i, e in enumerate(embeddings)])
    gates = []
    for i in range(len(models)):
        member = (owner == i).astype(np.float64)
        share = member.mean()
        weights = np.where(member == 1, 0.5 / share, 0.5 / (1 - share))
        gates.append(fit_logistic(everything, member, c, weights=weights))
    return [replace(model, gate=gate) for model, gate in zip(models, gates, strict=True)]


@dataclass
class DomainData:
    file: DataFile
    embeddings: FloatArray
    small: FloatArray = field(init=False)
    large: FloatArray = field(init=False)
    texts: list[str] = field(init=False)
    features: FloatArray = field(init=False)

    def __post_init__(self) -> None:
        self.small, self.large = labels(self.file.rows)
        self.texts = [r.prompt for r in self.file.rows]
        self.features = text_feature_matrix(self.texts)

    def fit(
        self,
        index: npt.NDArray[np.intp],
        c: float,
        weight: float,
        target: HeadTarget = "outcomes",
    ) -> DomainModel:
        return fit_domain(
            self.file.name,
            self.embeddings[index],
            self.features[index],
            self.small[index],
            self.large[index],
            c,
            weight,
            target=target,
        )


def out_of_fold_route_scores(
    data: DomainData,
    full: DifficultyEstimator,
    c: float,
    weight: float,
    folds: int,
    seed: int,
    target: HeadTarget = "outcomes",
) -> FloatArray:
    """Scores of ``data`` from estimators whose domain ``data.file.name`` never saw the row."""
    n = len(data.file.rows)
    scores = np.zeros(n)
    texts = data.texts
    position = [d.name for d in full.domains].index(data.file.name)
    for test in stratified_folds(data.small, data.large, folds, seed):
        train = np.setdiff1d(np.arange(n), test)
        domains = list(full.domains)
        refit = data.fit(train, c, weight, target)
        domains[position] = replace(refit, gate=full.domains[position].gate)
        fold = DifficultyEstimator(domains, threshold=full.threshold, dim=full.dim)
        scores[test] = fold.score_batch(data.embeddings[test], [texts[i] for i in test])
    return scores


def _select_route(
    data: DomainData,
    folds: int,
    repeats: int,
    seed: int,
    grid: Sequence[tuple[float, float, HeadTarget]] | None = None,
) -> dict[str, Any]:
    n = len(data.file.rows)
    results = []
    for c, weight, target in ROUTE_GRID if grid is None else grid:
        values = []
        for r in range(repeats):
            scores = np.zeros(n)
            for test in stratified_folds(data.small, data.large, folds, seed + r):
                train = np.setdiff1d(np.arange(n), test)
                model = data.fit(train, c, weight, target)
                design = model.design_from_features(data.embeddings[test], data.features[test])
                scores[test] = model.gain(design)
            values.append(apgr(router_curve(scores, data.small, data.large)))
        results.append(
            {
                "l2_c": c,
                "text_weight": weight,
                "target": target,
                "cv_apgr": round(float(np.mean(values)), 4),
            }
        )
    best = max(results, key=lambda item: item["cv_apgr"])
    return {"best": best, "grid": results}


def _curve_summary(scores: FloatArray, small: FloatArray, large: FloatArray) -> dict[str, Any]:
    curve = router_curve(scores, small, large)
    c50, c80 = cpt(curve, 0.5), cpt(curve, 0.8)
    return {
        "apgr": round(apgr(curve), 4),
        "cpt50": None if c50 is None else round(c50, 4),
        "cpt80": None if c80 is None else round(c80, 4),
    }


def cascade_design(
    rows: Sequence[LabelledRow], difficulty: FloatArray, features: Sequence[str]
) -> FloatArray:
    signals = [
        answer_signals(SmallAnswer(r.small_response or "", r.small_logprobs), d)
        for r, d in zip(rows, difficulty, strict=True)
    ]
    return np.array([[s[f] for f in features] for s in signals], dtype=np.float64).reshape(
        len(rows), len(features)
    )


def fit_cascade(
    raw: FloatArray,
    small: FloatArray,
    large: FloatArray,
    features: Sequence[str],
    c: float,
    info: dict[str, Any] | None = None,
) -> CascadeVerifier:
    mean = np.nanmean(raw, axis=0)
    scale = np.nanstd(raw, axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    x = np.nan_to_num((raw - mean) / scale, nan=0.0)
    return CascadeVerifier(
        features=tuple(features),
        feature_mean=mean,
        feature_scale=scale,
        small=fit_logistic(x, small, c),
        large=fit_logistic(x, large, c),
        threshold=0.0,
        info={"l2_c": c, **(info or {})},
    )


def cascade_rows(rows: Sequence[LabelledRow]) -> npt.NDArray[np.intp]:
    return np.array([i for i, r in enumerate(rows) if r.small_response is not None], dtype=np.intp)


def cascade_features(rows: Sequence[LabelledRow]) -> tuple[str, ...]:
    with_logprobs = all(r.small_logprobs for r in rows)
    return tuple(f for f in CASCADE_FEATURES if with_logprobs or f not in LOGPROB_FEATURES)


def out_of_fold_cascade_scores(
    rows: Sequence[LabelledRow],
    difficulty: FloatArray,
    c: float,
    folds: int,
    seed: int,
    features: Sequence[str],
) -> FloatArray:
    small, large = labels(rows)
    raw = cascade_design(rows, difficulty, features)
    answers = [SmallAnswer(r.small_response or "", r.small_logprobs) for r in rows]
    scores = np.zeros(len(rows))
    for test in stratified_folds(small, large, folds, seed):
        train = np.setdiff1d(np.arange(len(rows)), test)
        verifier = fit_cascade(raw[train], small[train], large[train], features, c)
        scores[test] = verifier.score_batch([answers[i] for i in test], difficulty[test])
    return scores


def train(
    files: Sequence[DataFile],
    embed: Embed,
    *,
    folds: int = 5,
    repeats: int = 2,
    seed: int = 0,
    command: str = "",
    description: str = "",
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"data files must have distinct names: {names}")
    domains = [DomainData(f, embed([r.prompt for r in f.rows])) for f in files]
    selections = []
    models = []
    for data in domains:
        selection = _select_route(data, folds, repeats, seed)
        best = selection["best"]
        log(f"{data.file.name}: rows {len(data.file.rows)}, chose {best}")
        selections.append(selection)
        everything = np.arange(len(data.file.rows), dtype=np.intp)
        model = data.fit(everything, best["l2_c"], best["text_weight"], best["target"])
        models.append(replace(model, info={**model.info, "cv": selection}))
    models = with_gates(models, [d.embeddings for d in domains])
    dim = int(domains[0].embeddings.shape[1])
    estimator = DifficultyEstimator(models, threshold=0.0, dim=dim)
    oof = [
        out_of_fold_route_scores(
            d,
            estimator,
            s["best"]["l2_c"],
            s["best"]["text_weight"],
            folds,
            seed,
            s["best"]["target"],
        )
        for d, s in zip(domains, selections, strict=True)
    ]
    for data, scores, model in zip(domains, oof, models, strict=True):
        model.info["cv"]["out_of_fold"] = _curve_summary(scores, data.small, data.large)
    pooled = np.concatenate(oof)
    pooled_small = np.concatenate([d.small for d in domains])
    pooled_large = np.concatenate([d.large for d in domains])
    estimator = DifficultyEstimator(
        models,
        threshold=calibrate(DEFAULT_TARGET, pooled, pooled_small, pooled_large),
        calibration=table_from_scores(pooled, pooled_small, pooled_large),
        dim=dim,
    )
    artifact: dict[str, Any] = {
        "format": ARTIFACT_FORMAT,
        "embedding": {
            "model": EMBEDDING_MODEL,
            "dim": dim,
            "text": "last user message (or the completions prompt)",
        },
        "text_features": list(TEXT_FEATURES),
        "route": {**estimator.to_json(), "threshold_target": str(DEFAULT_TARGET)},
        "cascade": None,
    }
    cascade_parts = [(d, s, cascade_rows(d.file.rows)) for d, s in zip(domains, oof, strict=True)]
    rows = [d.file.rows[i] for d, _, index in cascade_parts for i in index]
    if rows:
        artifact["cascade"] = _train_cascade(
            rows,
            np.concatenate([s[index] for _, s, index in cascade_parts]),
            [d.file.name for d, _, index in cascade_parts if len(index)],
            folds,
            repeats,
            seed,
            log,
        )
    artifact["training"] = {
        "command": command,
        "date": dt.date.today().isoformat(),
        "seed": seed,
        "folds": folds,
        "repeats": repeats,
        "description": description,
        "data": [
            {
                "path": d.file.path,
                "name": d.file.name,
                "sha256": d.file.sha256,
                "rows": len(d.file.rows),
                "small_quality": round(float(d.small.mean()), 4),
                "large_quality": round(float(d.large.mean()), 4),
                "prompt_filter": PromptFilter.build(d.texts).to_json(),
            }
            for d in domains
        ],
    }
    return artifact


def _train_cascade(
    rows: Sequence[LabelledRow],
    difficulty: FloatArray,
    sources: list[str],
    folds: int,
    repeats: int,
    seed: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    features = cascade_features(rows)
    small, large = labels(rows)
    grid = []
    for c in CASCADE_GRID:
        values = [
            apgr(
                router_curve(
                    out_of_fold_cascade_scores(rows, difficulty, c, folds, seed + r, features),
                    small,
                    large,
                )
            )
            for r in range(repeats)
        ]
        grid.append({"l2_c": c, "cv_apgr": round(float(np.mean(values)), 4)})
    best = max(grid, key=lambda item: item["cv_apgr"])
    log(f"cascade: rows {len(rows)} from {sources}, chose {best}")
    oof = out_of_fold_cascade_scores(rows, difficulty, best["l2_c"], folds, seed, features)
    verifier = fit_cascade(
        cascade_design(rows, difficulty, features),
        small,
        large,
        features,
        best["l2_c"],
        {
            "sources": sources,
            "cv": {"grid": grid, "out_of_fold": _curve_summary(oof, small, large)},
        },
    )
    verifier = replace(
        verifier,
        threshold=calibrate(DEFAULT_TARGET, oof, small, large),
        calibration=table_from_scores(oof, small, large),
    )
    return {**verifier.to_json(), "threshold_target": str(DEFAULT_TARGET)}


def write_artifact(artifact: dict[str, Any], out: str | Path) -> None:
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(artifact, separators=(",", ":"), ensure_ascii=False)
    target.write_text(text + "\n", encoding="utf-8")
