"""Fitting the gate's model and exporting it to the runtime's flat tree arrays.

Histogram gradient boosting (scikit-learn) with monotonic constraints: more antonyms, more
sibling substitutions, a changed number or negation, a swap around a pivot can only lower the
score, a higher cosine or more shared words only raise it. The constraints are what a reader
of the features would expect of any sensible model, and they keep the trees from learning a
pattern of the training pairs that points the wrong way on pairs they have not seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from cache.pairfeatures import FEATURE_NAMES
from cache.verifier import TreeEnsemble

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

HYPERPARAMETERS: dict[str, Any] = {
    "max_iter": 250,
    "learning_rate": 0.06,
    "max_leaf_nodes": 15,
    "max_depth": 5,
    "min_samples_leaf": 30,
    "l2_regularization": 1.0,
}

# +1: the probability of "same meaning" may only rise with the feature; -1: only fall.
INCREASING = ("cosine", "key_jaccard", "content_jaccard", "shared_ratio", "sub_synonym")
DECREASING = (
    "sub_antonym",
    "sub_sibling",
    "sub_value",
    "sub_attribute",
    "sub_unrelated",
    "sub_unknown",
    "number_changed",
    "number_substituted",
    "negation_flip",
    "pivot_swaps",
    "changed_unit",
    "changed_person",
    "changed_time",
    "changed_language",
    "changed_place",
    "changed_organization",
    "changed_capitalised",
    "changed_unknown",
    "quantifier_changed",
    "ins_modifier",
    "runs",
)


def monotonic_constraints() -> list[int]:
    return [1 if f in INCREASING else -1 if f in DECREASING else 0 for f in FEATURE_NAMES]


def fit(x: Floats, y: Ints, weight: Floats, seed: int) -> Any:
    from sklearn.ensemble import HistGradientBoostingClassifier  # type: ignore[import-untyped]

    model = HistGradientBoostingClassifier(
        random_state=seed,
        monotonic_cst=monotonic_constraints(),
        early_stopping=False,
        **HYPERPARAMETERS,
    )
    model.fit(x, y, sample_weight=weight)
    return model


def export(model: Any, probe: Floats) -> TreeEnsemble:
    """Flatten the fitted trees; checked against sklearn's own scores on ``probe``."""
    predictors = [p[0] for p in model._predictors]
    depth = max(int(p.nodes["depth"].max()) for p in predictors)
    width = max(len(p.nodes) for p in predictors)
    shape = (len(predictors), width)
    feature = np.full(shape, -1, dtype=np.int64)
    threshold = np.zeros(shape)
    left = np.tile(np.arange(width, dtype=np.int64), (len(predictors), 1))
    right = left.copy()
    value = np.zeros(shape)
    for i, predictor in enumerate(predictors):
        nodes = predictor.nodes
        n = len(nodes)
        leaf = nodes["is_leaf"].astype(bool)
        if (nodes["is_categorical"].astype(bool) & ~leaf).any():
            raise ValueError("categorical splits are not supported by the runtime")
        feature[i, :n] = np.where(leaf, -1, nodes["feature_idx"])
        threshold[i, :n] = np.where(leaf, 0.0, nodes["num_threshold"])
        left[i, :n] = np.where(leaf, np.arange(n), nodes["left"])
        right[i, :n] = np.where(leaf, np.arange(n), nodes["right"])
        value[i, :n] = np.where(leaf, nodes["value"], 0.0)
    base = float(np.ravel(model._baseline_prediction)[0])
    ensemble = TreeEnsemble(base, 1.0, depth, feature, threshold, left, right, value, False)
    drift = float(np.abs(ensemble.decision(probe) - model.decision_function(probe)).max())
    if drift > 1e-6:
        raise ValueError(f"exported trees disagree with scikit-learn by {drift:g}")
    return ensemble
