"""Train the semantic cache's verifier on labelled dev pairs and write its JSON artifact.

    python -m cache.train_verifier \\
        --pairs $LLM_GATEWAY_DATA/paraphrase/pairs_dev.tsv --out cache/artifacts/verifier.json

Procedure (deterministic: fixed seeds, fixed hyperparameters, nothing tuned on other data):

1. Embed every text with all-MiniLM-L6-v2 and compute ``cache.verifier.pair_features``
   (text_a plays the stored entry, text_b the new query). Vetoed pairs (a number
   substitution) score 0 in every step below, as they do at run time.
2. Threshold: out-of-fold probabilities from ``--repeats`` x ``--folds`` stratified CV;
   the shipped threshold is the lowest probability at which the out-of-fold hits (pairs
   above the cosine floor and the threshold) still reach ``--target-precision``.
3. Honest estimate: nested CV. Each outer fold repeats step 2 on its training part alone,
   fits on it and is scored on the untouched fold; the pooled counts are what we report.
4. Fit on all pairs, check the exported trees reproduce sklearn's scores, write the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.training.pairs import default_embedding_cache, embed_cached, read_pairs
from cache.verifier import FEATURE_NAMES, TreeEnsemble, Verifier, feature_matrix, vetoed

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

HYPERPARAMETERS: dict[str, Any] = {
    "n_estimators": 200,
    "learning_rate": 0.05,
    "max_depth": 3,
    "min_samples_leaf": 20,
    "subsample": 0.8,
}


@dataclass(frozen=True)
class GateCounts:
    hits: int
    true_hits: int
    positives: int
    pairs: int

    @property
    def precision(self) -> float:
        return self.true_hits / self.hits if self.hits else 1.0

    @property
    def recall(self) -> float:
        return self.true_hits / self.positives if self.positives else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "precision": round(self.precision, 4),
            "recall": round(self.recall, 4),
            "hits": self.hits,
            "pairs": self.pairs,
        }


def _fit(x: Floats, y: Ints, seed: int) -> Any:
    from sklearn.ensemble import GradientBoostingClassifier  # type: ignore[import-untyped]

    model = GradientBoostingClassifier(random_state=seed, **HYPERPARAMETERS)
    model.fit(x, y)
    return model


def _oof_probabilities(x: Floats, y: Ints, folds: int, repeats: int, seed: int) -> Floats:
    from sklearn.model_selection import StratifiedKFold  # type: ignore[import-untyped]

    total = np.zeros(len(y))
    for r in range(repeats):
        split = StratifiedKFold(folds, shuffle=True, random_state=seed + r)
        for train, test in split.split(x, y):
            total[test] += _fit(x[train], y[train], seed + r).predict_proba(x[test])[:, 1]
    return np.where(vetoed(x), 0.0, total / repeats)


def choose_threshold(
    scores: Floats, y: Ints, eligible: npt.NDArray[np.bool_], target: float
) -> float:
    """Lowest score whose hits (eligible and score >= it) keep precision >= target."""
    order = np.argsort(-np.where(eligible, scores, -np.inf), kind="stable")
    order = order[eligible[order]]
    if len(order) == 0:
        return 1.0
    true_hits = np.cumsum(y[order])
    precision = true_hits / np.arange(1, len(order) + 1)
    ok = np.nonzero(precision >= target)[0]
    if len(ok) == 0:
        return 1.0
    return float(scores[order[ok[-1]]])


def gate_counts(accept: npt.NDArray[np.bool_], y: Ints) -> GateCounts:
    return GateCounts(
        hits=int(accept.sum()),
        true_hits=int((accept & (y == 1)).sum()),
        positives=int((y == 1).sum()),
        pairs=len(y),
    )


def nested_cv(
    x: Floats,
    y: Ints,
    cosine: Floats,
    floor: float,
    target: float,
    folds: int,
    repeats: int,
    seed: int,
    log: Callable[[str], None],
) -> tuple[GateCounts, GateCounts]:
    """Pooled held-out counts of (verifier gate, cosine-only gate), thresholds chosen inside."""
    from sklearn.model_selection import StratifiedKFold

    gate = np.zeros(4, dtype=np.int64)
    plain = np.zeros(4, dtype=np.int64)
    for r in range(repeats):
        split = StratifiedKFold(folds, shuffle=True, random_state=1000 + seed + r)
        for k, (train, test) in enumerate(split.split(x, y)):
            eligible = cosine[train] >= floor
            inner = _oof_probabilities(x[train], y[train], folds, 1, seed + 7 * r + k)
            threshold = choose_threshold(inner, y[train], eligible, target)
            model = _fit(x[train], y[train], seed)
            p = np.where(vetoed(x[test]), 0.0, model.predict_proba(x[test])[:, 1])
            counts = gate_counts((cosine[test] >= floor) & (p >= threshold), y[test])
            cos_t = choose_threshold(cosine[train], y[train], np.ones(len(train), bool), target)
            cos_counts = gate_counts(cosine[test] >= cos_t, y[test])
            gate += [counts.hits, counts.true_hits, counts.positives, counts.pairs]
            plain += [cos_counts.hits, cos_counts.true_hits, cos_counts.positives, cos_counts.pairs]
            log(
                f"  outer {r}.{k}: threshold {threshold:.3f} -> precision "
                f"{counts.precision:.3f} recall {counts.recall:.3f} | cosine>={cos_t:.3f} "
                f"precision {cos_counts.precision:.3f} recall {cos_counts.recall:.3f}"
            )
    return GateCounts(*map(int, gate)), GateCounts(*map(int, plain))


def export(model: Any) -> TreeEnsemble:
    trees = [est[0].tree_ for est in model.estimators_]
    depth = max(int(t.max_depth) for t in trees)
    width = max(int(t.node_count) for t in trees)
    shape = (len(trees), width)
    feature = np.full(shape, -1, dtype=np.int64)
    threshold = np.zeros(shape)
    left = np.tile(np.arange(width, dtype=np.int64), (len(trees), 1))
    right = left.copy()
    value = np.zeros(shape)
    for i, tree in enumerate(trees):
        n = int(tree.node_count)
        internal = tree.children_left[:n] >= 0
        feature[i, :n] = np.where(internal, tree.feature[:n], -1)
        threshold[i, :n] = np.where(internal, tree.threshold[:n], 0.0)
        left[i, :n] = np.where(internal, tree.children_left[:n], np.arange(n))
        right[i, :n] = np.where(internal, tree.children_right[:n], np.arange(n))
        value[i, :n] = tree.value[:n, 0, 0]
    lr = float(model.learning_rate)
    probe = np.zeros((1, len(FEATURE_NAMES)))
    partial = TreeEnsemble(0.0, lr, depth, feature, threshold, left, right, value)
    base = float(model.decision_function(probe)[0] - partial.decision(probe)[0])
    return TreeEnsemble(base, lr, depth, feature, threshold, left, right, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cache.train_verifier", description=__doc__)
    parser.add_argument("--pairs", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cosine-floor", type=float, default=0.70)
    parser.add_argument("--target-precision", type=float, default=0.975)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nested-repeats", type=int, default=2, help="0 skips the estimate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embedding-cache", type=Path, default=default_embedding_cache())
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from cache.embedder import SentenceTransformerEmbedder

    started = time.perf_counter()
    pairs = read_pairs(args.pairs)
    embedder = SentenceTransformerEmbedder()
    a = embed_cached(embedder, [p.text_a for p in pairs], args.embedding_cache)
    b = embed_cached(embedder, [p.text_b for p in pairs], args.embedding_cache)
    cosine = np.einsum("ij,ij->i", a, b).astype(np.float64)
    y = np.array([p.label for p in pairs], dtype=np.int64)
    x = feature_matrix([p.text_a for p in pairs], [p.text_b for p in pairs], cosine)
    log(f"{len(pairs)} pairs, {int(y.sum())} positive, {x.shape[1]} features")

    estimate: dict[str, Any] = {}
    if args.nested_repeats > 0:
        log("nested cross-validation (thresholds chosen inside each outer training part):")
        gate, plain = nested_cv(
            x, y, cosine, args.cosine_floor, args.target_precision,
            args.folds, args.nested_repeats, args.seed, log,
        )  # fmt: skip
        estimate = {"verifier": gate.as_dict(), "cosine_only": plain.as_dict()}
        log(f"nested CV, verifier gate: {gate.as_dict()}")
        log(f"nested CV, cosine only:   {plain.as_dict()}")

    eligible = cosine >= args.cosine_floor
    oof = _oof_probabilities(x, y, args.folds, args.repeats, args.seed)
    threshold = choose_threshold(oof, y, eligible, args.target_precision)
    oof_counts = gate_counts(eligible & (oof >= threshold), y)
    log(f"shipped threshold {threshold:.4f}; out-of-fold at it: {oof_counts.as_dict()}")

    model = _fit(x, y, args.seed)
    ensemble = export(model)
    drift = np.abs(ensemble.decision(x) - model.decision_function(x)).max()
    if drift > 1e-6:
        raise SystemExit(f"exported trees disagree with sklearn by {drift:g}")
    verifier = Verifier(
        ensemble,
        threshold=threshold,
        cosine_floor=args.cosine_floor,
        metadata={
            "trained_on": args.pairs.name,
            "pairs": len(pairs),
            "embedding_model": embedder.model_id.split(":")[0],
            "hyperparameters": HYPERPARAMETERS,
            "target_precision": args.target_precision,
            "folds": args.folds,
            "repeats": args.repeats,
            "seed": args.seed,
            "out_of_fold_at_threshold": oof_counts.as_dict(),
            "nested_cv_estimate": estimate,
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(verifier.to_json(), separators=(",", ":")) + "\n")
    size_kb = args.out.stat().st_size / 1024
    log(f"wrote {args.out} ({size_kb:.0f} KiB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
