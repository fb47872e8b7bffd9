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

Statement pairs (``cache.statements``: both texts declarative prose, such as news sentences)
are judged by a second ensemble (``StatementModel``) over the same features and a few more
(shared n-grams, words only one side has), trained on the statement pairs of the news and
question pairs. Both gates must accept: the statement model's score counts only where the
request model's own probability, before its vetoes, is at least ``STATEMENT_GUARD`` (0.5:
it does not find the pair more likely different than same), no changed number vetoes it
(``STATEMENT_ALWAYS``) and, when the two texts differ in at most ``STATEMENT_FOCUS`` words,
none of ``STATEMENT_VETOES`` nor of the request vetoes fires (an antonym, a flipped negation,
a swap around a pivot, another value: a near miss written as a statement) and, when one of
those words is a content word replaced by another, the request model's probability reaches
the request gate's own threshold (a one-word substitution is judged as strictly as in a
question: "annual"/"monthly subscription", "Gold"/"Silver tier"). Its threshold
comes from its own calibration, targeted at precision
(``threshold_for_statements(min_precision)``); the rules beside the statement model only
turn hits into misses, so that calibration still bounds what it serves.

The artifact is JSON: the feature names, the trees as flat arrays, the calibration tables and
the out-of-fold figures; inference is pure numpy (all trees walked at once, depth steps).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache import diff
from cache.calibration import NEVER, CalibrationTable, PrecisionTable
from cache.lexicon import Lexicon
from cache.pairfeatures import FEATURE_NAMES, RELATIONS, feature_matrix
from cache.statements import STATEMENT_FEATURE_NAMES, statement_features, statement_pair

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

    @cached_property
    def _flat(self) -> tuple[npt.NDArray[np.int64], ...]:
        """Each tree's first node in the flattened arrays, then feature, left and right
        flattened (node indices made absolute): one gather per step instead of 2-D indexing."""
        n_trees, width = self.feature.shape
        offsets = (np.arange(n_trees, dtype=np.int64) * width)[None, :]
        return (
            offsets,
            self.feature.ravel(),
            (self.left + offsets.T).ravel(),
            (self.right + offsets.T).ravel(),
        )

    def decision(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        if self.float32:
            x = np.asarray(x, dtype=np.float32).astype(np.float64)
        else:
            x = np.asarray(x, dtype=np.float64)
        offsets, feature, left, right = self._flat
        threshold, value = self.threshold.ravel(), self.value.ravel()
        rows = np.arange(x.shape[0])[:, None]
        node = np.repeat(offsets, x.shape[0], axis=0)
        # A leaf (feature -1) points to itself both ways, so whichever way its (meaningless)
        # comparison with the last column goes, a sample that reached it stays there.
        for _ in range(self.depth):
            go_left = x[rows, feature[node]] <= threshold[node]
            node = np.where(go_left, left[node], right[node])
        leaf_sum = value[node].sum(axis=1)
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
DEFAULT_MIN_PRECISION = 0.98
STATEMENT_GUARD = 0.5
STATEMENT_FOCUS = 4
STATEMENT_VETOES = ("number_substituted", "sub_antonym", "negation_flip")
# Request vetoes that refuse a statement pair however many words changed: "200 grams" in
# one recipe and "250 grams" in a reworded one are not the same request.
STATEMENT_ALWAYS = ("number_substituted",)
_CHANGED = FEATURE_NAMES.index("changed_total")
# A content word replaced by another, however WordNet relates the two ("annual"/"monthly").
_REPLACED = [FEATURE_NAMES.index(f"sub_{r}") for r in RELATIONS]


def _sigmoid(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.asarray(1.0 / (1.0 + np.exp(-z)), dtype=np.float64)


@dataclass(frozen=True)
class StatementModel:
    """The gate of statement pairs: its trees read the request features followed by
    ``STATEMENT_FEATURE_NAMES``; its threshold is set for a precision."""

    model: TreeEnsemble
    calibration: PrecisionTable
    guard: float = STATEMENT_GUARD
    focus: int = STATEMENT_FOCUS
    vetoes: tuple[str, ...] = STATEMENT_VETOES

    def threshold_for(self, min_precision: float) -> float:
        return self.calibration.threshold_for(min_precision)

    def scores(
        self,
        x: npt.NDArray[np.float64],
        extra: npt.NDArray[np.float64],
        request_p: npt.NDArray[np.float64],
        focused_bar: float | None = None,
    ) -> npt.NDArray[np.float64]:
        """0 where the request model finds the pair less likely same than ``guard`` or a
        focused veto fires, or, with ``focused_bar``, where the texts differ in at most
        ``focus`` words, one of them a content word replaced by another, and the request
        model's probability is under that bar; else the statement model's probability."""
        p = _sigmoid(self.model.decision(np.hstack([x, extra])))
        columns = [FEATURE_NAMES.index(v) for v in self.vetoes]
        focused = x[:, _CHANGED] <= self.focus
        veto = focused & (x[:, columns] > 0).any(axis=1)
        if focused_bar is not None:
            replaced = (x[:, _REPLACED] > 0).any(axis=1)
            veto |= focused & replaced & (request_p < focused_bar)
        return np.where(veto | (request_p < self.guard), 0.0, p)

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(STATEMENT_FEATURE_NAMES),
            "guard": self.guard,
            "focus": self.focus,
            "vetoes": list(self.vetoes),
            "calibration": self.calibration.to_json(),
            "model": self.model.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatementModel:
        if tuple(data["features"]) != STATEMENT_FEATURE_NAMES:
            raise ValueError("statement features do not match this version's")
        vetoes = tuple(data["vetoes"])
        unknown = [v for v in vetoes if v not in FEATURE_NAMES]
        if unknown:
            raise ValueError(f"unknown veto features: {unknown}")
        return cls(
            TreeEnsemble.from_json(data["model"]),
            PrecisionTable.from_json(data["calibration"]),
            float(data["guard"]),
            int(data["focus"]),
            vetoes,
        )


@dataclass(frozen=True)
class Assessment:
    """Per candidate: whether it is a statement pair, and its score for that kind's threshold
    (the request gate's, or the statement gate's)."""

    statement: npt.NDArray[np.bool_]
    score: npt.NDArray[np.float64]


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
        statements: StatementModel | None = None,
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
        self.statements = statements

    @property
    def threshold(self) -> float:
        """The threshold at the default bound (``DEFAULT_MAX_FALSE_HIT_RATE``)."""
        return self.threshold_for(DEFAULT_MAX_FALSE_HIT_RATE)

    def threshold_for(self, max_false_hit_rate: float) -> float:
        return self.calibration.threshold_for(max_false_hit_rate)

    def threshold_for_statements(self, min_precision: float) -> float:
        """Statement pairs' threshold; with no statement model they are never served."""
        if self.statements is None:
            return NEVER
        return self.statements.threshold_for(min_precision)

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
            statements=StatementModel.from_json(data["statements"])
            if "statements" in data
            else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradient_boosted_trees",
            "features": list(FEATURE_NAMES),
            "cosine_floor": self.cosine_floor,
            "vetoes": list(self.vetoes),
            "calibration": self.calibration.to_json(),
            "model": self.model.to_json(),
            **({"statements": self.statements.to_json()} if self.statements else {}),
            "metadata": self.metadata,
        }

    def vetoed(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
        if not self._veto_columns:
            return np.zeros(x.shape[0], dtype=bool)
        return np.asarray((x[:, self._veto_columns] > 0).any(axis=1))

    def _statement_vetoed(self, x: npt.NDArray[np.float64], focus: int) -> npt.NDArray[np.bool_]:
        """The request vetoes that hold for statement pairs: all of them where the texts
        differ in at most ``focus`` words (a swap, a value, an antonym is then the whole
        difference), ``STATEMENT_ALWAYS`` whatever the number of changed words (beyond a few,
        the aligner's pivots and value pairs in reworded prose are mostly noise; a different
        number is not)."""
        always = [self.vetoes.index(v) for v in STATEMENT_ALWAYS if v in self.vetoes]
        fired = x[:, self._veto_columns] > 0
        focused = x[:, _CHANGED] <= focus
        return np.asarray((fired.any(axis=1) & focused) | fired[:, always].any(axis=1))

    def scores_from_features(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.where(self.vetoed(x), 0.0, _sigmoid(self.model.decision(x)))

    def probabilities(
        self, stored: Sequence[str], queries: Sequence[str], cosines: Sequence[float]
    ) -> npt.NDArray[np.float64]:
        """The model's probability that the stored answer serves the query; 0 when vetoed."""
        if not stored:
            return np.zeros(0, dtype=np.float64)
        return self.scores_from_features(feature_matrix(stored, queries, cosines))

    @staticmethod
    def prepare(stored: str) -> None:
        """Do the stored text's own share of a comparison now (its tokens are remembered), so
        that a lookup later reads it rather than computes it."""
        diff.prepare(stored)

    def score(self, stored: str, query: str, cosine: float) -> float:
        """The request gate's score of one pair (whatever kind of pair it is)."""
        return float(self.probabilities([stored], [query], [cosine])[0])

    def assess(
        self,
        stored: Sequence[str],
        queries: Sequence[str],
        cosines: Sequence[float],
        request_threshold: float | None = None,
    ) -> Assessment:
        """Each pair's kind and score: statement pairs by the statement gate (when the
        artifact has one), the others by the request gate.

        The request gate's vetoes hold for statement pairs too (``_statement_vetoed``: a
        changed number always; a swap around a pivot, a value or an antonym when at most
        ``focus`` words changed). A statement pair that differs in at most ``focus`` words,
        one of them a content word replaced by another, is a substitution like a question's
        ("annual"/"monthly subscription", "Gold"/"Silver tier"), so it must also pass the
        request gate's own bar, ``request_threshold`` (the gate's threshold for the
        namespace; default: the one at ``DEFAULT_MAX_FALSE_HIT_RATE``)."""
        lex = Lexicon.shared()
        x = feature_matrix(stored, queries, cosines, lex)
        request_p = _sigmoid(self.model.decision(x))
        score = np.where(self.vetoed(x), 0.0, request_p)
        statement = np.zeros(len(score), dtype=bool)
        if self.statements is not None:
            statement = np.array(
                [statement_pair(a, b, lex) for a, b in zip(stored, queries, strict=True)],
                dtype=bool,
            ).reshape(len(score))
        if statement.any() and self.statements is not None:
            rows = np.nonzero(statement)[0]
            extra = np.array(
                [statement_features(stored[i], queries[i], lex) for i in rows.tolist()],
                dtype=np.float64,
            ).reshape(len(rows), len(STATEMENT_FEATURE_NAMES))
            bar = self.threshold if request_threshold is None else request_threshold
            judged = self.statements.scores(x[rows], extra, request_p[rows], bar)
            score[rows] = np.where(
                self._statement_vetoed(x[rows], self.statements.focus), 0.0, judged
            )
        return Assessment(statement, score)
