"""Nested cross-validation of the difficulty estimator's training procedure, one data file.

``python -m routing.router_cv --data FILE [--targets outcomes gain_sign] [--outer-repeats 5]``

Each outer repeat splits the file into stratified folds (seeds ``--outer-seed`` onwards). For each
outer fold, the hyperparameters are chosen on the other folds exactly as ``train-router`` chooses
them (``--folds`` x ``--repeats`` inner cross-validation from seed 0, restricted to the heads'
targets given), the heads are fitted there and the held-out fold is scored. The APGR of each
repeat's pooled held-out scores estimates what the whole procedure (selection included) delivers
on unseen rows of the same kind. Domain gates are left out: each row is scored by its own
domain's heads (the gate routes dev prompts to their domain almost without error).

Slow on large files: MMLU dev (6,996 rows) takes ~8 min per outer repeat on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from routing.difficulty import HEAD_TARGETS, HeadTarget
from routing.training.curves import apgr, router_curve
from routing.training.router_data import Embed, cached_embedder, load_data
from routing.training.train_router import ROUTE_GRID, DomainData, _select_route, stratified_folds


def nested_apgr(
    data: DomainData,
    targets: Sequence[HeadTarget],
    *,
    outer_repeats: int = 5,
    outer_seed: int = 10,
    folds: int = 5,
    repeats: int = 2,
) -> dict[str, Any]:
    grid = [setting for setting in ROUTE_GRID if setting[2] in targets]
    n = len(data.file.rows)
    values: list[float] = []
    chosen: list[dict[str, Any]] = []
    for r in range(outer_repeats):
        scores = np.zeros(n)
        for test in stratified_folds(data.small, data.large, folds, outer_seed + r):
            train = np.setdiff1d(np.arange(n), test)
            inner = DomainData(
                replace(data.file, rows=tuple(data.file.rows[i] for i in train)),
                data.embeddings[train],
            )
            best = _select_route(inner, folds, repeats, 0, grid)["best"]
            chosen.append(best)
            model = data.fit(train, best["l2_c"], best["text_weight"], best["target"])
            design = model.design_from_features(data.embeddings[test], data.features[test])
            scores[test] = model.gain(design)
        values.append(apgr(router_curve(scores, data.small, data.large)))
    return {
        "data": data.file.path,
        "targets": list(targets),
        "apgr_per_repeat": [round(v, 4) for v in values],
        "mean": round(float(np.mean(values)), 4),
        "sd": round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else None,
        "chosen": chosen,
    }


def main(argv: Sequence[str] | None = None, embed: Embed | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routing.router_cv", description=__doc__)
    parser.add_argument("--data", required=True, help="labelled JSONL file (one domain)")
    parser.add_argument("--targets", nargs="+", choices=HEAD_TARGETS, default=list(HEAD_TARGETS))
    parser.add_argument("--outer-repeats", type=int, default=5)
    parser.add_argument("--outer-seed", type=int, default=10)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="inner selection repeats")
    args = parser.parse_args(argv)
    file = load_data(args.data)
    vectors = (embed or cached_embedder())([r.prompt for r in file.rows])
    result = nested_apgr(
        DomainData(file, vectors),
        args.targets,
        outer_repeats=args.outer_repeats,
        outer_seed=args.outer_seed,
        folds=args.folds,
        repeats=args.repeats,
    )
    chosen = result.pop("chosen")
    print(json.dumps(result))
    settings = [(c["l2_c"], c["text_weight"], c["target"]) for c in chosen]
    counts = {str(s): settings.count(s) for s in sorted(set(settings), key=str)}
    print(f"settings chosen per outer fold: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
