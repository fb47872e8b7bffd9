"""Train the semantic cache's gate, calibrate its operating points, write the artifact.

    python -m cache.training.train_gate --out cache/artifacts/verifier.json

Procedure (deterministic: fixed seeds and hyperparameters):

1. Pairs (``cache.training.dataset``): perturbations of real questions, ``pairs_dev.tsv`` and
   ``pairs_nearmiss_dev.tsv``; features of each (``cache.pairfeatures``) with MiniLM cosine;
   which are statement pairs (``cache.statements``) and their statement features.
2. The request gate's out-of-fold scores of every dev pair under three splits, the
   perturbations always in training: ``topic`` (near-miss pairs in 5 topic-disjoint folds,
   dev pairs in 5 stratified folds), ``plain`` (5 stratified folds) and ``kind`` (leave one near-miss
   kind out: the model never saw a pair of that kind). ``unseen`` trains on perturbations and
   pairs_dev only and scores the whole near-miss file. A pair below the cosine floor or
   vetoed scores 0; the raw probability (no veto) is kept for the statement gate's guard.
3. The statement gate's out-of-fold scores (``cache.training.statement_model``): dev
   statement pairs in 5 topic-disjoint folds of the dev pairs (news sentences about one
   event share a fold), near-miss statement pairs in every split.
4. Calibration (``cache.training.gate_calibration``): the request table from each near-miss
   pair's worst request score over the three splits (one split alone puts the threshold at
   the edge of whichever near miss its folds happened to score highest); the statement
   table from the dev statement pairs' scores; figures of every split with both gates.
5. Fit both gates on everything, export the trees (checked against scikit-learn), write the
   JSON with the tables, the out-of-fold scores (so a test can recompute every recorded
   figure) and the figures at the default operating points.
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

from cache.lexicon import Lexicon
from cache.pairfeatures import FEATURE_NAMES
from cache.training import statement_model
from cache.training.data import paraphrase_file
from cache.training.dataset import Table, build, statement_part
from cache.training.gate_calibration import Calibrated, Pairs, calibrate, stored_scores
from cache.training.model import HYPERPARAMETERS, export, fit, monotonic_constraints
from cache.training.pairs import read_pairs
from cache.verifier import StatementModel, TreeEnsemble, Verifier

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

WEIGHTS = {"gen": 0.3, "dev": 5.0, "nearmiss": 5.0}
VETOES = ("number_substituted", "sub_antonym", "sub_value", "pivot_swaps")
FILES = ("pairs_dev.tsv", "pairs_nearmiss_dev.tsv")


def _weights(table: Table) -> Floats:
    return np.array([WEIGHTS[o] for o in table.origin], dtype=np.float64)


def gate_scores(model: Any, table: Table, floor: float) -> tuple[Floats, Floats]:
    """(gated, raw): the request gate's score (vetoes and floor applied) and its probability."""
    p = np.asarray(model.predict_proba(table.x)[:, 1], dtype=np.float64)
    veto = np.zeros(len(p), dtype=bool)
    for name in VETOES:
        veto |= table.x[:, FEATURE_NAMES.index(name)] > 0
    return np.where(veto | (table.cosine < floor), 0.0, p), p


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


def tests_of(table: Table, scheme: str, seed: int) -> list[Mask]:
    """The test sets of a split: which pairs each of its models does not see."""
    near = table.origin == "nearmiss"
    dev = table.origin == "dev"
    if scheme in ("topic", "plain"):
        # Dev pairs in stratified folds in both: the request gate's calibration reads the
        # near-miss scores, and those move with the dev pairs each model happens to see.
        fold = np.maximum(
            _folds(table, near, 5, seed, grouped=scheme == "topic"),
            _folds(table, dev, 5, seed, grouped=False),
        )
        return [fold == f for f in range(5)]
    if scheme == "devtopic":  # the statement gate's split: dev pairs in topic-disjoint folds
        fold = _folds(table, dev, 5, seed, grouped=True)
        return [fold == f for f in range(5)]
    if scheme == "kind":
        return [near & (table.source == s) for s in sorted(set(table.source[near]))]
    if scheme == "unseen":
        return [near]
    raise ValueError(scheme)


def out_of_fold(
    table: Table, scheme: str, floor: float, seed: int, log: Callable[[str], None]
) -> tuple[Floats, Floats]:
    """Request-gate scores (gated, raw) of dev and near-miss pairs from models that did not
    see them (NaN: not scored)."""
    gated, raw = np.full(len(table.label), np.nan), np.full(len(table.label), np.nan)
    weight = _weights(table)
    tests = tests_of(table, scheme, seed)
    for k, test in enumerate(tests):
        model = fit(table.x[~test], table.label[~test], weight[~test], seed + k)
        gated[test], raw[test] = gate_scores(model, table.where(test), floor)
        log(f"  {scheme} split {k + 1}/{len(tests)}")
    return gated, raw


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pairs(table: Table) -> Pairs:
    return Pairs(table.origin, table.source, table.label, table.statement)


def dev_pairs() -> Pairs:
    """The dev files as ``Pairs`` (dev first, then near-miss), statement pairs marked."""
    dev, near = (read_pairs(paraphrase_file(name)) for name in FILES)
    both = [*dev, *near]
    statement, _ = statement_part(
        [p.text_a for p in both], [p.text_b for p in both], Lexicon.shared()
    )
    return Pairs(
        np.array(["dev"] * len(dev) + ["nearmiss"] * len(near)),
        np.array([p.source for p in both]),
        np.array([p.label for p in both], dtype=np.int64),
        statement,
    )


def _store(calibrated: Calibrated, pairs: Pairs, data: dict[str, Any]) -> None:
    data["metadata"]["pairs"] = pairs.to_json()
    data["calibration"] = calibrated.requests.to_json()
    data["statements"]["calibration"] = calibrated.statements.to_json()
    data["metadata"]["calibrated_on"] = calibrated.calibrating
    data["metadata"]["out_of_fold_at_default"] = calibrated.report


def recalibrate(path: Path) -> None:
    """Rebuild an artifact's tables and figures from the out-of-fold scores it stores."""
    data = json.loads(path.read_text())
    pairs = dev_pairs()
    request, statement = stored_scores(pairs, data["metadata"])
    _store(calibrate(pairs, request, statement), pairs, data)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")


def _scores_json(table: Table, request: dict[str, Floats], statement: dict[str, Floats]) -> Any:
    """Out-of-fold scores as stored: near-miss pairs per split, dev pairs of the topic split;
    statement scores of the statement pairs only (file order)."""
    dev, near = table.origin == "dev", table.origin == "nearmiss"

    def values(scores: Floats, mask: Mask) -> list[float]:
        return [float(v) for v in scores[mask]]

    return (
        {
            **{f"nearmiss_{s}": values(request[s], near) for s in request},
            "dev_topic": values(request["topic"], dev),
        },
        {
            **{f"nearmiss_{s}": values(statement[s], near & table.statement) for s in statement},
            "dev_topic": values(statement["topic"], dev & table.statement),
        },
    )


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
    floor = args.cosine_floor
    table = build(args.seeds, args.per_source, args.seed, args.embedding_cache)
    counts = dict(zip(*np.unique(table.origin, return_counts=True), strict=True))
    log(f"{len(table.label)} pairs ({counts}), {int(table.statement.sum())} statement pairs")
    request: dict[str, Floats] = {}
    raw: dict[str, Floats] = {}
    for scheme in args.schemes.split(","):
        gated, raw[scheme] = out_of_fold(table, scheme, floor, args.seed, log)
        request[scheme] = np.round(gated, 4)  # as stored: the figures follow from the artifact
    dev_tests = tests_of(table, "devtopic", args.seed)
    full, statement = statement_model.out_of_fold(table, dev_tests, raw, floor, args.seed)
    statement = {s: np.round(v, 4) for s, v in statement.items()}
    calibrated = calibrate(_pairs(table), request, statement)
    for scheme, fig in calibrated.report.items():
        log(f"{scheme}: {json.dumps(fig)}")

    model = fit(table.x, table.label, _weights(table), args.seed)
    ensemble: TreeEnsemble = export(model, table.x)
    dev = table.origin == "dev"
    request_json, statement_json = _scores_json(table, request, statement)
    verifier = Verifier(
        ensemble,
        calibrated.requests,
        cosine_floor=floor,
        vetoes=VETOES,
        statements=StatementModel(full.model, calibrated.statements),
        metadata={
            "embedding_model": "all-MiniLM-L6-v2",
            "trained_on": {o: int((table.origin == o).sum()) for o in ("gen", "dev", "nearmiss")},
            "statements_trained_on": int((dev & table.statement).sum()),
            "hyperparameters": HYPERPARAMETERS,
            "monotonic": monotonic_constraints(),
            "weights": WEIGHTS,
            "seed": args.seed,
            "seeds": args.seeds,
            "per_source": args.per_source,
            "data_sha256": {name: _sha(paraphrase_file(name)) for name in FILES},
            "out_of_fold_at_default": calibrated.report,
            "calibrated_on": calibrated.calibrating,
            "out_of_fold_scores": request_json,
            "statement_scores": statement_json,
            "pairs": dev_pairs().to_json(),  # labels and kinds of the scored pairs, in order
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(verifier.to_json(), separators=(",", ":")) + "\n")
    size = args.out.stat().st_size / 1024
    log(f"wrote {args.out} ({size:.0f} KiB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
