"""Difficulty estimator: is the large model worth calling for this request?

The score is the expected accuracy gain of the large tier over the small one,
``P(large correct | x) - P(small correct | x)``, in [-1, 1]. Ranking by this gain, not by
"the small model fails", is what routing needs: a request both tiers fail, or both answer, gains
nothing from the large call (on the dev data the gain ranking scores about 0.05 APGR more).

Inputs, computed once per request by the gateway:

* the sentence embedding of the last user message (all-MiniLM-L6-v2, unit norm; the same vector
  the semantic cache uses);
* cheap text features of that message (``text_features``: length, numbers, math symbols,
  quantity and question words, negations), standardised with the training mean and scale.

Model: one pair of L2-regularised logistic regressions per training domain (one domain per
training file: for example GSM8K and MMLU). A single model over all domains learns the larger
domain and loses the smaller one (GSM8K falls from 0.63 to 0.57 APGR in cross-validation), so
each domain keeps its own heads, and a gate picks the heads for a request: one-vs-rest
logistic regressions over the embedding ("is this prompt from domain d?"), the highest logit
wins. (A nearest-centroid gate sent 12 % of MMLU prompts, the arithmetic ones,
to the GSM8K heads.) Every domain scores in the same unit (expected gain), so one threshold
serves them all.

A domain's pair of heads models one of two targets, chosen per domain by cross-validation at
training time (``target``; the score is the expected gain either way):

* ``outcomes``: ``P(small correct)`` and ``P(large correct)``; gain = the difference;
* ``gain_sign``: ``P(only the large tier is correct)`` and ``P(only the small tier is correct)``;
  gain = the difference again (the rows both tiers answer, or both fail, are the zero class).
  Each head then learns only what separates the rows where the choice matters: on GSM8K dev,
  repeated nested cross-validation gives 0.671 APGR against 0.656 for ``outcomes``
  (``docs/benchmarks.md``); on MMLU ``outcomes`` stays ahead and is kept.

The heads are stored as ``small`` (subtracted) and ``large`` (added) for both targets, so
serving computes ``large - small`` without looking at the target.

Runtime is pure numpy over a JSON artifact of a few tens of kilobytes
(``routing/artifacts/difficulty.json``), written by ``llm-gateway train-router``, which also
records the data, the command and the cross-validated figures that produced it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from policies.models import CalibrationTarget
from routing.calibration import CalibrationTable, wants_large

FloatArray = npt.NDArray[np.float64]
Tier = Literal["small", "large"]

ARTIFACT_FORMAT = "llm-gateway/tier-router/v1"
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "difficulty.json"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
EMBEDDING_DIM = 384

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_FRACTION = re.compile(r"\d\s*/\s*\d")
_DECIMAL = re.compile(r"\d\.\d")
_MATH_SYMBOL = re.compile("[=+*/^<>%\u00d7\u00f7\u221a\u2211\u222b\u03c0]|\\s-\\s")
_QUANTITY = re.compile(
    r"\b(half|twice|double|triple|third|quarter|times|each|per|every|total|remaining|rest|"
    r"percent|average|ratio)\b",
    re.IGNORECASE,
)
_QUESTION = re.compile(r"\b(what|how|why|which|when|who|where|whom|whose)\b", re.IGNORECASE)
_NEGATION = re.compile(r"\b(not|except|false|incorrect|least|never|no)\b", re.IGNORECASE)

TEXT_FEATURES: tuple[str, ...] = (
    "log_chars",
    "log_words",
    "log_lines",
    "log_sentences",
    "log_numbers",
    "log_big_numbers",
    "log_fractions",
    "log_decimals",
    "log_math_symbols",
    "log_quantity_words",
    "log_question_words",
    "log_negations",
    "has_percent",
    "has_currency",
)


def text_features(text: str) -> FloatArray:
    """Cheap features of a prompt, in the order of ``TEXT_FEATURES``."""
    numbers = _NUMBER.findall(text)
    counts = (
        len(text),
        len(text.split()),
        text.count("\n") + 1,
        text.count(".") + text.count("?") + text.count("!"),
        len(numbers),
        sum(1 for n in numbers if len(n.replace(",", "").split(".")[0]) >= 4),
        len(_FRACTION.findall(text)),
        len(_DECIMAL.findall(text)),
        len(_MATH_SYMBOL.findall(text)),
        len(_QUANTITY.findall(text)),
        len(_QUESTION.findall(text)),
        len(_NEGATION.findall(text)),
    )
    flags = (float("%" in text), float(any(c in text for c in "$€£¥")))
    return np.array([math.log1p(c) for c in counts] + list(flags), dtype=np.float64)


def text_feature_matrix(texts: Sequence[str]) -> FloatArray:
    if not texts:
        return np.zeros((0, len(TEXT_FEATURES)), dtype=np.float64)
    return np.vstack([text_features(t) for t in texts])


def _floats(values: Any, name: str, length: int | None = None) -> FloatArray:
    out = np.asarray(values, dtype=np.float64).reshape(-1)
    if length is not None and len(out) != length:
        raise ValueError(f"{name}: expected {length} values, got {len(out)}")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name}: non-finite value")
    return out


def compact(values: FloatArray, digits: int = 6) -> list[float]:
    """Floats for JSON, rounded to ``digits`` significant digits (keeps artifacts small)."""
    return [float(f"{v:.{digits}g}") for v in values.tolist()]


@dataclass(frozen=True)
class LogisticHead:
    """``P(y = 1 | x) = sigmoid(x . coef + intercept)``."""

    coef: FloatArray
    intercept: float

    def probability(self, features: FloatArray) -> FloatArray:
        z = features @ self.coef + self.intercept
        result: FloatArray = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid without overflow
        return result

    def to_json(self) -> dict[str, Any]:
        return {"coef": compact(self.coef), "intercept": float(f"{self.intercept:.6g}")}

    @classmethod
    def from_json(cls, data: dict[str, Any], length: int) -> LogisticHead:
        return cls(_floats(data["coef"], "coef", length), float(data["intercept"]))


HeadTarget = Literal["outcomes", "gain_sign"]
HEAD_TARGETS: tuple[HeadTarget, ...] = ("outcomes", "gain_sign")


def head_labels(
    target: HeadTarget, small: FloatArray, large: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """The 0/1 labels of the ``(small, large)`` heads for ``target``; large - small = gain."""
    if target == "outcomes":
        return small, large
    if target == "gain_sign":
        return small * (1 - large), large * (1 - small)
    raise ValueError(f"unknown head target {target!r}; expected one of {HEAD_TARGETS}")


@dataclass(frozen=True)
class DomainModel:
    """One domain's heads; ``gain = large.probability - small.probability`` for any target.

    ``target`` says what the heads estimate (module docstring): for ``outcomes``, ``small`` and
    ``large`` are the tiers' probabilities of being correct; for ``gain_sign``, the
    probabilities that only the small (only the large) tier is correct.
    """

    name: str
    gate: LogisticHead  # over the embedding: "the prompt belongs to this domain"
    feature_mean: FloatArray
    feature_scale: FloatArray
    small: LogisticHead
    large: LogisticHead
    info: dict[str, Any]  # hyperparameters and cross-validated figures, for the record
    target: HeadTarget = "outcomes"

    def design(self, embeddings: FloatArray, texts: Sequence[str]) -> FloatArray:
        return self.design_from_features(embeddings, text_feature_matrix(texts))

    def design_from_features(self, embeddings: FloatArray, features: FloatArray) -> FloatArray:
        standard = (features - self.feature_mean) / self.feature_scale
        return np.hstack([embeddings, standard])

    def gain(self, design: FloatArray) -> FloatArray:
        result: FloatArray = self.large.probability(design) - self.small.probability(design)
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gate": self.gate.to_json(),
            "feature_mean": compact(self.feature_mean),
            "feature_scale": compact(self.feature_scale),
            "small": self.small.to_json(),
            "large": self.large.to_json(),
            "target": self.target,
            "info": self.info,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], dim: int) -> DomainModel:
        width = dim + len(TEXT_FEATURES)
        scale = _floats(data["feature_scale"], "feature_scale", len(TEXT_FEATURES))
        if np.any(scale <= 0):
            raise ValueError("feature_scale must be positive")
        target = data.get("target", "outcomes")  # artifacts before the target was recorded
        if target not in HEAD_TARGETS:
            raise ValueError(f"unknown head target {target!r}")
        return cls(
            name=str(data["name"]),
            gate=LogisticHead.from_json(data["gate"], dim),
            feature_mean=_floats(data["feature_mean"], "feature_mean", len(TEXT_FEATURES)),
            feature_scale=scale,
            small=LogisticHead.from_json(data["small"], width),
            large=LogisticHead.from_json(data["large"], width),
            info=dict(data.get("info", {})),
            target=target,
        )


@dataclass(frozen=True)
class DifficultyScore:
    """``p_small`` / ``p_large``: the domain's two heads (``DomainModel``; what they estimate
    depends on its ``target``); ``score = p_large - p_small`` either way."""

    score: float  # expected gain of the large tier, in [-1, 1]
    domain: str
    p_small: float
    p_large: float


class DifficultyEstimator:
    """Scores requests from their embedding and text; thread-safe (immutable)."""

    def __init__(
        self,
        domains: Sequence[DomainModel],
        *,
        threshold: float,
        calibration: CalibrationTable | None = None,
        dim: int = EMBEDDING_DIM,
    ) -> None:
        if not domains:
            raise ValueError("a difficulty estimator needs at least one domain")
        self.domains = tuple(domains)
        self.threshold = threshold
        self.calibration = calibration
        self.dim = dim
        self._gate_coef = np.vstack([d.gate.coef for d in self.domains])
        self._gate_intercept = np.array([d.gate.intercept for d in self.domains])

    def _check(self, embeddings: Any, texts: Sequence[str]) -> FloatArray:
        rows = np.asarray(embeddings, dtype=np.float64)
        if rows.ndim == 1:
            rows = rows.reshape(1, -1)
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"embeddings must have {self.dim} columns, got shape {rows.shape}")
        if rows.shape[0] != len(texts):
            raise ValueError("one text per embedding row")
        return rows

    def domain_index(self, embeddings: Any) -> npt.NDArray[np.intp]:
        rows = np.asarray(embeddings, dtype=np.float64).reshape(-1, self.dim)
        logits = rows @ self._gate_coef.T + self._gate_intercept
        result: npt.NDArray[np.intp] = np.argmax(logits, axis=1)
        return result

    def probabilities(
        self, embeddings: Any, texts: Sequence[str]
    ) -> tuple[FloatArray, FloatArray, npt.NDArray[np.intp]]:
        """``(small head, large head, domain index)`` per row; the gain is large - small."""
        rows = self._check(embeddings, texts)
        which = self.domain_index(rows)
        p_small = np.zeros(len(rows))
        p_large = np.zeros(len(rows))
        for i, domain in enumerate(self.domains):
            mask = which == i
            if not mask.any():
                continue
            design = domain.design(rows[mask], [t for t, m in zip(texts, mask, strict=True) if m])
            p_small[mask] = domain.small.probability(design)
            p_large[mask] = domain.large.probability(design)
        return p_small, p_large, which

    def score_batch(self, embeddings: Any, texts: Sequence[str]) -> FloatArray:
        p_small, p_large, _ = self.probabilities(embeddings, texts)
        result: FloatArray = p_large - p_small
        return result

    def score(self, embedding: Any, text: str) -> DifficultyScore:
        p_small, p_large, which = self.probabilities(embedding, [text])
        return DifficultyScore(
            score=float(p_large[0] - p_small[0]),
            domain=self.domains[int(which[0])].name,
            p_small=float(p_small[0]),
            p_large=float(p_large[0]),
        )

    def threshold_for(self, target: CalibrationTarget) -> float:
        if self.calibration is None:
            raise ValueError("this artifact carries no calibration table: give a threshold")
        return self.calibration.threshold_for(target)

    def to_json(self) -> dict[str, Any]:
        return {
            "score": "P(large correct) - P(small correct)",
            "threshold": self.threshold,
            "domains": [d.to_json() for d in self.domains],
            "calibration": self.calibration.to_json() if self.calibration else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], dim: int = EMBEDDING_DIM) -> DifficultyEstimator:
        table = data.get("calibration")
        return cls(
            [DomainModel.from_json(d, dim) for d in data["domains"]],
            threshold=float(data["threshold"]),
            calibration=CalibrationTable.from_json(table) if table else None,
            dim=dim,
        )


@dataclass(frozen=True)
class RouteDecision:
    tier: Tier
    score: float
    threshold: float
    domain: str


class DifficultyRouter:
    """Route mode: the large tier iff the difficulty score reaches the threshold."""

    def __init__(self, estimator: DifficultyEstimator, threshold: float | None = None) -> None:
        self.estimator = estimator
        self.threshold = estimator.threshold if threshold is None else threshold

    def decide_batch(self, embeddings: Any, texts: Sequence[str]) -> list[RouteDecision]:
        p_small, p_large, which = self.estimator.probabilities(embeddings, texts)
        scores = p_large - p_small
        large = wants_large(scores, self.threshold)
        return [
            RouteDecision(
                tier="large" if bool(big) else "small",
                score=float(score),
                threshold=self.threshold,
                domain=self.estimator.domains[int(w)].name,
            )
            for score, big, w in zip(scores, large, which, strict=True)
        ]

    def decide(self, embedding: Any, text: str) -> RouteDecision:
        return self.decide_batch(embedding, [text])[0]


def read_artifact(path: str | Path | None = None) -> dict[str, Any]:
    source = Path(path) if path is not None else DEFAULT_ARTIFACT
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read router artifact {source}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"{source}: not a {ARTIFACT_FORMAT} artifact")
    return data


def load_estimator(path: str | Path | None = None) -> DifficultyEstimator:
    """The estimator of an artifact (default: the one shipped in the package)."""
    data = read_artifact(path)
    return DifficultyEstimator.from_json(data["route"], int(data["embedding"]["dim"]))
