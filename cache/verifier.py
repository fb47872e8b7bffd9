"""Quality gate of the semantic cache: is a stored question's answer right for a new one?

Cosine similarity alone cannot separate paraphrases from near misses: negated, reversed or
re-targeted questions score 0.83-0.99 with MiniLM. The gate looks again at every candidate
above the cosine floor with a small gradient-boosted tree ensemble over features of the
*difference* between the two texts (``cache.pairfeatures``: the words that changed, how
WordNet relates each replaced word to its replacement, numbers, negation, order and swaps)
and their cosine. Some differences veto a pair outright whatever the model says (listed in
the artifact's ``vetoes``; a changed number is one): the answer to another number is the
false hit users notice first.

The score threshold is not a constant: ``threshold_for(max_false_hit_rate)`` reads it from the
calibration table shipped in the artifact (``cache.calibration``), the lowest threshold whose
out-of-fold false-hit rate, as a one-sided 95% upper bound, stays within the operator's bound.

The artifact is JSON: the feature names, the trees as flat arrays, the calibration table and
the out-of-fold figures; inference is pure numpy (all trees walked at once, depth steps).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.calibration import CalibrationTable
from cache.lexicon import Lexicon
from cache.pairfeatures import FEATURE_NAMES, feature_matrix

DEFAULT_ARTIFACT = Path(__file__).with_name("artifacts") / "verifier.json"


@dataclass(frozen=True)
class TreeEnsemble:
    """Gradient-boosted regression trees on the log-odds scale, stored as flat arrays.

    Node arrays have shape (n_trees, max_nodes); a leaf has feature -1 and points to itself,
    so walking ``depth`` steps from the root lands every sample on its leaf in every tree.
    ``float32``: compare features in single precision (trees fitted by sklearn's classic
    GradientBoosting); histogram gradient boosting compares in double precision.
    """

    base_score: float
    learning_rate: float
    depth: int
    feature: npt.NDArray[np.int64]
    threshold: npt.NDArray[np.float64]
    left: npt.NDArray[np.int64]
    right: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]
    float32: bool = True

    def decision(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        if self.float32:
            x = np.asarray(x, dtype=np.float32).astype(np.float64)
        else:
            x = np.asarray(x, dtype=np.float64)
        trees = np.arange(self.feature.shape[0])[None, :]
        samples = np.arange(x.shape[0])[:, None]
        node = np.zeros((x.shape[0], self.feature.shape[0]), dtype=np.int64)
        for _ in range(self.depth):
            feat = self.feature[trees, node]
            go_left = x[samples, np.maximum(feat, 0)] <= self.threshold[trees, node]
            step = np.where(go_left, self.left[trees, node], self.right[trees, node])
            node = np.where(feat >= 0, step, node)
        leaf_sum = self.value[trees, node].sum(axis=1)
        return np.asarray(self.base_score + self.learning_rate * leaf_sum, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        return {
            "base_score": self.base_score,
            "learning_rate": self.learning_rate,
            "depth": self.depth,
            "feature": self.feature.tolist(),
            "threshold": self.threshold.tolist(),
            "left": self.left.tolist(),
            "right": self.right.tolist(),
            "value": [[round(float(v), 6) for v in row] for row in self.value],
            "float32": self.float32,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TreeEnsemble:
        return cls(
            base_score=float(data["base_score"]),
            learning_rate=float(data["learning_rate"]),
            depth=int(data["depth"]),
            feature=np.asarray(data["feature"], dtype=np.int64),
            threshold=np.asarray(data["threshold"], dtype=np.float64),
            left=np.asarray(data["left"], dtype=np.int64),
            right=np.asarray(data["right"], dtype=np.int64),
            value=np.asarray(data["value"], dtype=np.float64),
            float32=bool(data.get("float32", True)),
        )


DEFAULT_MAX_FALSE_HIT_RATE = 0.01


class Verifier:
    """Scores (stored text, query) pairs; ``threshold_for`` maps a false-hit bound to a
    score threshold through the shipped calibration."""

    def __init__(
        self,
        model: TreeEnsemble,
        calibration: CalibrationTable,
        cosine_floor: float,
        vetoes: Sequence[str] = (),
        metadata: dict[str, Any] | None = None,
    ) -> None:
        unknown = [v for v in vetoes if v not in FEATURE_NAMES]
        if unknown:
            raise ValueError(f"unknown veto features: {unknown}")
        self.model = model
        self.calibration = calibration
        self.cosine_floor = cosine_floor
        self.vetoes = tuple(vetoes)
        self._veto_columns = [FEATURE_NAMES.index(v) for v in self.vetoes]
        self.metadata = metadata or {}

    @property
    def threshold(self) -> float:
        """The threshold at the default bound (``DEFAULT_MAX_FALSE_HIT_RATE``)."""
        return self.threshold_for(DEFAULT_MAX_FALSE_HIT_RATE)

    def threshold_for(self, max_false_hit_rate: float) -> float:
        return self.calibration.threshold_for(max_false_hit_rate)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_ARTIFACT) -> Verifier:
        data = json.loads(Path(path).read_text())
        if tuple(data["features"]) != FEATURE_NAMES:
            raise ValueError(f"{path}: features do not match this version's FEATURE_NAMES")
        Lexicon.shared()  # a loaded gate is ready to score: WordNet is read here, not mid-lookup
        return cls(
            TreeEnsemble.from_json(data["model"]),
            CalibrationTable.from_json(data["calibration"]),
            cosine_floor=float(data["cosine_floor"]),
            vetoes=data.get("vetoes", []),
            metadata=data.get("metadata", {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradient_boosted_trees",
            "features": list(FEATURE_NAMES),
            "cosine_floor": self.cosine_floor,
            "vetoes": list(self.vetoes),
            "calibration": self.calibration.to_json(),
            "model": self.model.to_json(),
            "metadata": self.metadata,
        }

    def vetoed(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
        if not self._veto_columns:
            return np.zeros(x.shape[0], dtype=bool)
        return np.asarray((x[:, self._veto_columns] > 0).any(axis=1))

    def scores_from_features(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        p = 1.0 / (1.0 + np.exp(-self.model.decision(x)))
        return np.where(self.vetoed(x), 0.0, p)

    def probabilities(
        self, stored: Sequence[str], queries: Sequence[str], cosines: Sequence[float]
    ) -> npt.NDArray[np.float64]:
        """The model's probability that the stored answer serves the query; 0 when vetoed."""
        if not stored:
            return np.zeros(0, dtype=np.float64)
        return self.scores_from_features(feature_matrix(stored, queries, cosines))

    def score(self, stored: str, query: str, cosine: float) -> float:
        return float(self.probabilities([stored], [query], [cosine])[0])
