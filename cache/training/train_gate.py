"""Train the semantic cache's gate, calibrate its operating point, write the artifact.

    python -m cache.training.train_gate --out cache/artifacts/verifier.json

Procedure (deterministic: fixed seeds and hyperparameters):

1. Pairs (``cache.training.dataset``): perturbations of real questions, ``pairs_dev.tsv`` and
   ``pairs_nearmiss_dev.tsv``; features of each (``cache.pairfeatures``) with MiniLM cosine.
2. Out-of-fold scores of every dev pair under three splits, the perturbations always in
   training: ``topic`` (near-miss pairs in 5 topic-disjoint folds, dev pairs in 5 stratified
   folds), ``plain`` (5 stratified folds) and ``kind`` (leave one near-miss kind out: the
   model never saw a pair of that kind). ``unseen`` trains on perturbations and pairs_dev only
   and scores the whole near-miss file. A pair below the cosine floor or vetoed scores 0.
3. Calibration: each near-miss pair's worst case over the three splits (the highest of its
   out-of-fold scores for a near miss, the lowest for a paraphrase) gives the table
   threshold -> false hits / near misses, hits / paraphrases (``cache.calibration``); the
   operating point for a bound is the lowest threshold whose one-sided 95% Wilson upper
   bound on the false-hit rate is within it. One split alone puts the threshold at the edge
   of whichever near miss its folds happened to score highest; the worst case over three
   does not depend on one fold assignment.
4. Fit on everything, export the trees (checked against scikit-learn), write the JSON with
   the table, the out-of-fold scores (so a test can recompute every recorded figure) and the
   figures of each split at the default operating point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.calibration import CalibrationTable, wilson
from cache.pairfeatures import FEATURE_NAMES
from cache.training.data import paraphrase_file
from cache.training.dataset import Table, build
from cache.training.model import HYPERPARAMETERS, export, fit, monotonic_constraints
from cache.training.pairs import read_pairs
from cache.verifier import DEFAULT_MAX_FALSE_HIT_RATE, TreeEnsemble, Verifier

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

WEIGHTS = {"gen": 0.3, "dev": 5.0, "nearmiss": 5.0}
VETOES = ("number_substituted", "sub_antonym", "sub_value", "pivot_swaps")
THRESHOLDS = tuple(
    sorted(
        {
            round(float(t), 4)
            for t in [
                *np.arange(0.02, 0.96, 0.02),
                *np.arange(0.96, 0.999, 0.002),
                *np.arange(0.999, 1.0, 0.0002),
            ]
        }
    )
)


def _weights(table: Table) -> Floats:
    return np.array([WEIGHTS[o] for o in table.origin], dtype=np.float64)


def gate_scores(model: Any, table: Table, floor: float) -> Floats:
    p = model.predict_proba(table.x)[:, 1]
    veto = np.zeros(len(p), dtype=bool)
    for name in VETOES:
        veto |= table.x[:, FEATURE_NAMES.index(name)] > 0
    return np.where(veto | (table.cosine < floor), 0.0, p)


def _folds(table: Table, mask: Mask, k: int, seed: int, grouped: bool) -> npt.NDArray[np.int64]:
    from sklearn.model_selection import GroupKFold, StratifiedKFold  # type: ignore[import-untyped]

    idx = np.nonzero(mask)[0]
    fold = np.full(len(table.label), -1, dtype=np.int64)
    if grouped:
        splits = GroupKFold(k).split(idx, table.label[idx], table.group[idx])
    else:
        splits = StratifiedKFold(k, shuffle=True, random_state=seed).split(idx, table.label[idx])
    for f, (_, test) in enumerate(splits):
        fold[idx[test]] = f
    return fold


def out_of_fold(
    table: Table, scheme: str, floor: float, seed: int, log: Callable[[str], None]
) -> Floats:
    """Scores of dev and near-miss pairs from models that did not see them (NaN: not scored)."""
    oof = np.full(len(table.label), np.nan)
    weight = _weights(table)
    near = table.origin == "nearmiss"
    dev = table.origin == "dev"
    if scheme in ("topic", "plain"):
        fold = np.maximum(
            _folds(table, near, 5, seed, grouped=scheme == "topic"),
            _folds(table, dev, 5, seed, grouped=False),
        )
        tests = [fold == f for f in range(5)]
    elif scheme == "kind":
        tests = [near & (table.source == s) for s in sorted(set(table.source[near]))]
    elif scheme == "unseen":
        tests = [near]
    else:
        raise ValueError(scheme)
    for k, test in enumerate(tests):
        model = fit(table.x[~test], table.label[~test], weight[~test], seed + k)
        oof[test] = gate_scores(model, table.where(test), floor)
        log(f"  {scheme} split {k + 1}/{len(tests)}")
    return oof


def figures(table: Table, scores: Floats, threshold: float) -> dict[str, Any]:
    """Near-miss false-hit rate (overall, per kind), paraphrase recall, dev precision/recall."""
    out: dict[str, Any] = {"threshold": threshold}
    scored = ~np.isnan(scores)
    hit = scored & (np.nan_to_num(scores) >= threshold)
    near = scored & (table.origin == "nearmiss")
    if near.any():
        neg, pos = near & (table.label == 0), near & (table.label == 1)
        fh, n = int((hit & neg).sum()), int(neg.sum())
        out["nearmiss"] = {
            "false_hit_rate": _rate(fh, n),
            "paraphrase_recall": _rate(int((hit & pos).sum()), int(pos.sum())),
            "by_source": {
                s: _rate(
                    int((hit & near & (table.source == s)).sum()),
                    int((near & (table.source == s)).sum()),
                )
                for s in sorted(set(table.source[near]))
            },
        }
    dev = scored & (table.origin == "dev")
    if dev.any():
        hits, true_hits = int((hit & dev).sum()), int((hit & dev & (table.label == 1)).sum())
        out["dev"] = {
            "precision": _rate(true_hits, hits),
            "recall": _rate(true_hits, int((dev & (table.label == 1)).sum())),
        }
    return out


def _rate(k: int, n: int) -> dict[str, Any]:
    low, high = wilson(k, n)
    return {
        "n": n,
        "hits": k,
        "rate": round(k / n, 4) if n else 0.0,
        "ci95": [round(low, 4), round(high, 4)],
    }


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def calibrate(
    table: Table, oof: dict[str, Floats]
) -> tuple[list[str], CalibrationTable, dict[str, Any]]:
    """The calibration table from each near-miss pair's worst out-of-fold score, and every
    split's figures at the default operating point."""
    if "topic" not in oof:
        raise SystemExit("the calibration needs the topic scheme")
    near = table.origin == "nearmiss"
    calibrating: list[str] = [s for s in ("topic", "plain", "kind") if s in oof]
    stacked = np.stack([oof[s][near] for s in calibrating])
    worst = np.where(table.label[near] == 0, stacked.max(axis=0), stacked.min(axis=0))
    calibration = CalibrationTable.from_scores(
        worst.tolist(), table.label[near].tolist(), THRESHOLDS
    )
    threshold = calibration.threshold_for(DEFAULT_MAX_FALSE_HIT_RATE)
    report = {s: figures(table, scores, threshold) for s, scores in oof.items()}
    return calibrating, calibration, report


def recalibrate(path: Path) -> None:
    """Rebuild an artifact's table and figures from the out-of-fold scores it stores."""
    data = json.loads(path.read_text())
    meta = data["metadata"]
    pairs = {n: read_pairs(paraphrase_file(f"pairs_{n}.tsv")) for n in ("dev", "nearmiss_dev")}
    dev, near = pairs["dev"], pairs["nearmiss_dev"]
    both = [*dev, *near]
    table = Table(
        np.array(["dev"] * len(dev) + ["nearmiss"] * len(near)),
        np.array([p.source for p in both]),
        np.array([p.label for p in both], dtype=np.int64),
        np.zeros(len(both), dtype=np.int64),
        np.zeros(len(both)),
        np.zeros((len(both), 0)),
        [p.text_a for p in both],
        [p.text_b for p in both],
    )
    stored = meta["out_of_fold_scores"]
    oof: dict[str, Floats] = {}
    for key, scores in stored.items():
        if key.startswith("nearmiss_"):
            scheme = key.removeprefix("nearmiss_")
            dev_part = stored["dev_topic"] if scheme == "topic" else [np.nan] * len(dev)
            oof[scheme] = np.array([*dev_part, *scores], dtype=np.float64)
    calibrating, calibration, report = calibrate(table, oof)
    data["calibration"] = calibration.to_json()
    meta["calibrated_on"] = calibrating
    meta["out_of_fold_at_default"] = report
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cache.training.train_gate", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=Path("cache/artifacts/verifier.json"))
    parser.add_argument("--cosine-floor", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, default=3000, help="real questions to perturb")
    parser.add_argument("--per-source", type=int, default=1200, help="pairs per perturbation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", default="topic,plain,kind,unseen")
    parser.add_argument("--embedding-cache", type=Path)
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="only rebuild --out's calibration and figures from its stored out-of-fold scores",
    )
    args = parser.parse_args(argv)
    if args.recalibrate:
        recalibrate(args.out)
        return 0

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    table = build(args.seeds, args.per_source, args.seed, args.embedding_cache)
    log(
        f"{len(table.label)} pairs ({dict(zip(*np.unique(table.origin, return_counts=True), strict=True))})"
    )
    # Rounded as stored in the artifact: the table and figures follow from what is stored.
    oof = {
        s: np.round(out_of_fold(table, s, args.cosine_floor, args.seed, log), 4)
        for s in args.schemes.split(",")
    }
    calibrating, calibration, report = calibrate(table, oof)
    for scheme, fig in report.items():
        log(f"{scheme}: {json.dumps(fig)}")
    near = table.origin == "nearmiss"

    everything = np.ones(len(table.label), dtype=bool)
    model = fit(table.x, table.label, _weights(table), args.seed)
    ensemble: TreeEnsemble = export(model, table.x[everything])
    dev_mask = table.origin == "dev"
    verifier = Verifier(
        ensemble,
        calibration,
        cosine_floor=args.cosine_floor,
        vetoes=VETOES,
        metadata={
            "embedding_model": "all-MiniLM-L6-v2",
            "trained_on": {o: int((table.origin == o).sum()) for o in ("gen", "dev", "nearmiss")},
            "hyperparameters": HYPERPARAMETERS,
            "monotonic": monotonic_constraints(),
            "weights": WEIGHTS,
            "seed": args.seed,
            "seeds": args.seeds,
            "per_source": args.per_source,
            "data_sha256": {
                name: _sha(paraphrase_file(name))
                for name in ("pairs_nearmiss_dev.tsv", "pairs_dev.tsv")
            },
            "out_of_fold_at_default": report,
            "calibrated_on": calibrating,
            "out_of_fold_scores": {
                **{f"nearmiss_{s}": [float(v) for v in oof[s][near]] for s in oof},
                "dev_topic": [float(v) for v in oof["topic"][dev_mask]],
            },
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(verifier.to_json(), separators=(",", ":")) + "\n")
    log(
        f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
