"""Quality gate of the semantic cache: is a stored question's answer right for a new one?

Cosine similarity alone cannot separate paraphrases from near misses (MiniLM on the dev pairs:
precision 0.92 costs recall 0.29). The gate looks again at every candidate above the policy's
cosine floor with a small gradient-boosted tree ensemble over pair features:

* the cosine of the two embeddings;
* word overlap (Jaccard, overlap over the shorter and the longer side), character 3-grams;
* numbers, negations and capitalised names present on one side only, or substituted (each
  side has one the other lacks); a number substitution vetoes the pair outright;
* content words (stopwords removed) present on one side only, per direction;
* the longest run of consecutive words of one side missing from the other, and the run at
  its end: near misses in news text typically add a clause ("... until elections are held"),
  paraphrases reword in place.

Element-wise products and differences of the two embeddings were tried: with ~3,000 training
pairs they overfit and lowered precision (see cache/train_verifier.py). The artifact is JSON:
the feature names, the trees as flat arrays and the probability threshold chosen by
cross-validation; inference is pure numpy (all trees walked at once, depth steps).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

DEFAULT_ARTIFACT = Path(__file__).with_name("artifacts") / "verifier.json"

_WORD = re.compile(r"[A-Za-z]+|\d+(?:[.,]\d+)*")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NAME = re.compile(r"[A-Za-z][\w'-]*")
_NEGATION = re.compile(
    r"\b(?:not|no|never|none|nobody|nothing|neither|nor|without|cannot)\b|n(?:'|\u2019)t\b",
    re.IGNORECASE,
)
_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "at",
        "for",
        "by",
        "with",
        "from",
        "and",
        "or",
        "but",
        "as",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "he",
        "she",
        "they",
        "them",
        "his",
        "her",
        "their",
        "we",
        "our",
        "you",
        "your",
        "i",
        "me",
        "my",
        "has",
        "have",
        "had",
        "do",
        "does",
        "did",
        "will",
        "would",
        "can",
        "could",
        "should",
        "may",
        "might",
        "shall",
        "which",
        "who",
        "whom",
        "whose",
        "what",
        "when",
        "where",
        "why",
        "how",
        "than",
        "then",
        "there",
        "here",
        "also",
        "s",
        "said",
        "says",
    ]
)

FEATURE_NAMES: tuple[str, ...] = (
    "cosine",
    "word_jaccard",
    "word_overlap_min",
    "word_overlap_max",
    "char3_jaccard",
    "number_mismatch",
    "number_diff_ratio",
    "has_numbers",
    "negation_mismatch",
    "negation_count_diff",
    "name_diff_ratio",
    "name_mismatch",
    "length_ratio",
    "log_length_diff",
    "content_only_stored",
    "content_only_query",
    "content_only_max",
    "content_only_min",
    "content_only_stored_frac",
    "content_only_query_frac",
    "content_jaccard",
    "run_max",
    "run_min",
    "content_run_max",
    "content_run_min",
    "tail_run_max",
    "run_query",
    "content_run_query",
    "number_substitution",
    "name_substitution",
)

# Pairs where each side has a number the other lacks ("4.5 million" vs "9.1 million") are
# never accepted, whatever the model says: serving the answer to another number is the false
# hit users notice first. Measured on the dev pairs (cross-validated, cache/train_verifier.py)
# the veto costs almost no recall.
VETO_FEATURE = "number_substitution"


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _names(text: str) -> set[str]:
    # Capitalised words after the first: a crude but cheap proper-name detector.
    words = _NAME.findall(text)
    return {w.lower() for w in words[1:] if w[0].isupper()}


def _char_grams(words: list[str], n: int = 3) -> set[str]:
    joined = " ".join(words)
    return {joined[i : i + n] for i in range(max(len(joined) - n + 1, 1))}


def _negations(text: str) -> int:
    return len(_NEGATION.findall(text))


def _runs(words: list[str], other: set[str]) -> tuple[int, int, int]:
    """Longest run of words missing from ``other``, the same counting content words only,
    and the length of the missing run at the end."""
    best = current = content_best = content_current = 0
    for word in words:
        if word in other:
            current = content_current = 0
            continue
        current += 1
        best = max(best, current)
        if word not in _STOPWORDS:
            content_current += 1
            content_best = max(content_best, content_current)
    tail = 0
    for word in reversed(words):
        if word in other:
            break
        tail += 1
    return best, content_best, tail


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def pair_features(stored: str, query: str, cosine: float) -> list[float]:
    """Features of one (stored text, new query) pair, in ``FEATURE_NAMES`` order."""
    wa, wb = _words(stored), _words(query)
    sa, sb = set(wa), set(wb)
    common = len(sa & sb)
    na = {n.replace(",", "") for n in _NUMBER.findall(stored)}
    nb = {n.replace(",", "") for n in _NUMBER.findall(query)}
    ma, mb = _names(stored), _names(query)
    ga, gb = _char_grams(wa), _char_grams(wb)
    neg_a, neg_b = _negations(stored), _negations(query)
    ca = {w for w in sa if w not in _STOPWORDS}
    cb = {w for w in sb if w not in _STOPWORDS}
    only_a, only_b = len(ca - cb), len(cb - ca)
    run_a, content_run_a, tail_a = _runs(wa, sb)
    run_b, content_run_b, tail_b = _runs(wb, sa)
    return [
        cosine,
        _ratio(common, len(sa | sb)),
        _ratio(common, min(len(sa), len(sb))),
        _ratio(common, max(len(sa), len(sb))),
        _ratio(len(ga & gb), len(ga | gb)),
        float(na != nb),
        _ratio(len(na ^ nb), len(na | nb)),
        float(bool(na or nb)),
        float(neg_a % 2 != neg_b % 2),
        float(abs(neg_a - neg_b)),
        _ratio(len(ma ^ mb), len(ma | mb)),
        float(ma != mb),
        _ratio(min(len(wa), len(wb)), max(len(wa), len(wb))),
        math.log1p(abs(len(wa) - len(wb))),
        float(only_a),
        float(only_b),
        float(max(only_a, only_b)),
        float(min(only_a, only_b)),
        _ratio(only_a, len(ca)),
        _ratio(only_b, len(cb)),
        _ratio(len(ca & cb), len(ca | cb)),
        float(max(run_a, run_b)),
        float(min(run_a, run_b)),
        float(max(content_run_a, content_run_b)),
        float(min(content_run_a, content_run_b)),
        float(max(tail_a, tail_b)),
        float(run_b),
        float(content_run_b),
        float(bool(na - nb) and bool(nb - na)),
        float(bool(ma - mb) and bool(mb - ma)),
    ]


def feature_matrix(
    stored: Sequence[str], queries: Sequence[str], cosines: Sequence[float]
) -> npt.NDArray[np.float64]:
    rows = [pair_features(a, b, float(c)) for a, b, c in zip(stored, queries, cosines, strict=True)]
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_NAMES))


@dataclass(frozen=True)
class TreeEnsemble:
    """Gradient-boosted regression trees on the log-odds scale, stored as flat arrays.

    Node arrays have shape (n_trees, max_nodes); a leaf has feature -1 and points to itself,
    so walking ``depth`` steps from the root lands every sample on its leaf in every tree.
    """

    base_score: float
    learning_rate: float
    depth: int
    feature: npt.NDArray[np.int64]
    threshold: npt.NDArray[np.float64]
    left: npt.NDArray[np.int64]
    right: npt.NDArray[np.int64]
    value: npt.NDArray[np.float64]

    def decision(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        # The trees were fitted on float32 features: compare in the same precision.
        x = np.asarray(x, dtype=np.float32).astype(np.float64)
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
        )


def scores_from_features(
    model: TreeEnsemble, x: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    p = 1.0 / (1.0 + np.exp(-model.decision(x)))
    return np.where(vetoed(x), 0.0, p)


def vetoed(x: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
    return np.asarray(x[:, FEATURE_NAMES.index(VETO_FEATURE)] > 0)


class Verifier:
    """Scores (stored text, query) pairs; ``accept`` applies the cross-validated threshold."""

    def __init__(
        self,
        model: TreeEnsemble,
        threshold: float,
        cosine_floor: float,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.threshold = threshold
        self.cosine_floor = cosine_floor
        self.metadata = metadata or {}

    @classmethod
    def load(cls, path: str | Path = DEFAULT_ARTIFACT) -> Verifier:
        data = json.loads(Path(path).read_text())
        if tuple(data["features"]) != FEATURE_NAMES:
            raise ValueError(f"{path}: features do not match this version's FEATURE_NAMES")
        return cls(
            TreeEnsemble.from_json(data["model"]),
            threshold=float(data["threshold"]),
            cosine_floor=float(data["cosine_floor"]),
            metadata=data.get("metadata", {}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradient_boosted_trees",
            "features": list(FEATURE_NAMES),
            "threshold": self.threshold,
            "cosine_floor": self.cosine_floor,
            "model": self.model.to_json(),
            "metadata": self.metadata,
        }

    def probabilities(
        self, stored: Sequence[str], queries: Sequence[str], cosines: Sequence[float]
    ) -> npt.NDArray[np.float64]:
        """The model's probability that the stored answer serves the query; 0 when vetoed."""
        if not stored:
            return np.zeros(0, dtype=np.float64)
        return scores_from_features(self.model, feature_matrix(stored, queries, cosines))

    def score(self, stored: str, query: str, cosine: float) -> float:
        return float(self.probabilities([stored], [query], [cosine])[0])
