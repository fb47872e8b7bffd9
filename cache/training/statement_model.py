"""Training the statement gate (``cache.verifier.StatementModel``) and its precision table.

Statement pairs (``cache.statements``: both texts declarative prose) are 2,852 of the 3,013
news and question pairs of ``pairs_dev.tsv`` and 7 of the 600 near-miss pairs. Procedure:

1. The model: histogram-boosted trees (the request gate's hyperparameters, no monotonic
   constraints: on news sentences a changed name or an added clause does not point one way)
   over the request features and the statement features, fitted on the statement pairs of
   ``pairs_dev.tsv`` only, unweighted. The perturbed questions and the near-miss file are
   requests; the request gate already reads them, and the statement gate must pass it too.
2. Out of fold: each dev statement pair is scored by a model fitted on the other four of
   five topic-disjoint folds of the dev pairs (first texts with cosine >= 0.6 share a fold:
   two news sentences about one event are never split between training and test); a
   near-miss statement pair by the model fitted on all dev statement pairs (it never sees the
   near-miss file). The guard reads the request model's raw out-of-fold probability of the
   same pair (the topic split's for dev pairs); a pair under the cosine floor scores 0.
3. The table: for each threshold, hits and correct hits among the dev statement pairs
   (``cache.calibration.PrecisionTable``); ``min_precision`` picks the lowest threshold whose
   out-of-fold precision reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.calibration import PrecisionTable
from cache.training.dataset import Table
from cache.training.model import HYPERPARAMETERS, export
from cache.verifier import StatementModel, TreeEnsemble

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

STATEMENT_THRESHOLDS = tuple(
    sorted(
        {round(float(t), 4) for t in [*np.arange(0.5, 0.9, 0.02), *np.arange(0.9, 0.9999, 0.0025)]}
    )
)


def inputs(table: Table) -> Floats:
    return np.hstack([table.x, table.extra])


def fit(table: Table, seed: int) -> Any:
    from sklearn.ensemble import HistGradientBoostingClassifier  # type: ignore[import-untyped]

    model = HistGradientBoostingClassifier(
        random_state=seed, early_stopping=False, **HYPERPARAMETERS
    )
    model.fit(inputs(table), table.label)
    return model


def as_gate(model: Any, probe: Table) -> StatementModel:
    """The fitted trees as the runtime's statement gate (checked against scikit-learn)."""
    ensemble: TreeEnsemble = export(model, inputs(probe))
    return StatementModel(ensemble, PrecisionTable(()))


def gate_scores(gate: StatementModel, table: Table, request_raw: Floats, floor: float) -> Floats:
    """The runtime's statement score of each pair (guard and focused vetoes applied)."""
    scores = gate.scores(table.x, table.extra, request_raw)
    return np.where(table.cosine < floor, 0.0, scores)


def out_of_fold(
    table: Table,
    dev_tests: Sequence[Mask],
    raw: dict[str, Floats],
    floor: float,
    seed: int,
) -> tuple[StatementModel, dict[str, Floats]]:
    """The statement gate fitted on every dev statement pair, and out-of-fold statement
    scores per split (NaN: not a statement pair, or not scored in that split): dev statement
    pairs in topic-disjoint dev folds (under "topic"), near-miss statement pairs in every split."""
    dev = table.statement & (table.origin == "dev")
    near = table.statement & (table.origin == "nearmiss")
    full = as_gate(fit(table.where(dev), seed), table.where(dev))
    oof: dict[str, Floats] = {}
    for scheme, request_raw in raw.items():
        scores = np.full(len(table.label), np.nan)
        scores[near] = gate_scores(full, table.where(near), request_raw[near], floor)
        oof[scheme] = scores
    for k, test in enumerate(dev_tests):
        part = dev & test
        if not part.any():
            continue
        gate = as_gate(fit(table.where(dev & ~test), seed + k), table.where(dev & ~test))
        oof["topic"][part] = gate_scores(gate, table.where(part), raw["topic"][part], floor)
    return full, oof
