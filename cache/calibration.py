"""The gate's operating point: from an operator's bound on false hits to a score threshold.

Training (``cache.training.train_gate``) scores every labelled dev pair with a model that
never saw it (out-of-fold, topics kept apart), and ships a table in the artifact: for each
candidate threshold, how many near-miss pairs (label 0) would have been served (false hits)
out of how many, and how many same-meaning pairs would have hit. The false-hit rate of a
threshold is then stated as the upper end of a one-sided Wilson score interval at 95%
confidence, not as the raw count, so a small calibration set cannot promise more than it
measured (0 false hits in 360 pairs still says "at most 0.75%").

``CalibrationTable.threshold_for(max_false_hit_rate)`` returns the lowest threshold whose
upper bound is within the operator's bound; when none is, the gate accepts nothing
(threshold above 1) rather than promise a rate it cannot back.

Statement pairs (``cache.statements``) have a second table, ``PrecisionTable``: for each
threshold, the hits and correct hits among the statement pairs of the news and question
pairs, scored out of fold. Those pairs mix paraphrases and non-paraphrases as they come, so
what a threshold promises there is a precision (the share of served hits that are right).
``PrecisionTable.threshold_for(min_precision)`` returns the lowest threshold whose precision
reaches the operator's target with at least ``MIN_PRECISION_HITS`` hits behind it (a handful
of lucky pairs at the top backs nothing), or no threshold at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol, TypeVar

Z_ONE_SIDED_95 = 1.6448536269514722
Z_TWO_SIDED_95 = 1.959963984540054
NEVER = 1.01  # a threshold no score reaches
MIN_PRECISION_HITS = 30


def wilson(successes: int, n: int, z: float = Z_TWO_SIDED_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_upper(successes: int, n: int, z: float = Z_ONE_SIDED_95) -> float:
    return wilson(successes, n, z)[1]


class _Row(Protocol):
    @property
    def threshold(self) -> float: ...


RowT = TypeVar("RowT", bound=_Row)


def _row_at(rows: Sequence[RowT], threshold: float) -> RowT | None:
    """The first row at or above ``threshold`` (rows by increasing threshold)."""
    return next((row for row in rows if row.threshold >= threshold), None)


def _increasing(rows: tuple[RowT, ...]) -> tuple[RowT, ...]:
    if any(a.threshold >= b.threshold for a, b in pairwise(rows)):
        raise ValueError("calibration rows must have increasing thresholds")
    return rows


@dataclass(frozen=True, slots=True)
class CalibrationRow:
    threshold: float
    false_hits: int  # near-miss pairs (label 0) accepted
    negatives: int
    true_hits: int  # same-meaning pairs (label 1) accepted
    positives: int

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.negatives if self.negatives else 0.0

    @property
    def false_hit_upper(self) -> float:
        return wilson_upper(self.false_hits, self.negatives)

    @property
    def recall(self) -> float:
        return self.true_hits / self.positives if self.positives else 0.0

    def as_list(self) -> list[float | int]:
        return [self.threshold, self.false_hits, self.negatives, self.true_hits, self.positives]


@dataclass(frozen=True)
class CalibrationTable:
    rows: tuple[CalibrationRow, ...]  # increasing threshold

    @classmethod
    def from_scores(
        cls,
        scores: Sequence[float],
        labels: Sequence[int],
        thresholds: Sequence[float],
    ) -> CalibrationTable:
        rows = []
        negatives = sum(1 for y in labels if y == 0)
        positives = len(labels) - negatives
        for t in sorted(thresholds):
            fh = sum(1 for s, y in zip(scores, labels, strict=True) if y == 0 and s >= t)
            th = sum(1 for s, y in zip(scores, labels, strict=True) if y == 1 and s >= t)
            rows.append(CalibrationRow(round(float(t), 4), fh, negatives, th, positives))
        return cls(tuple(rows))

    def threshold_for(self, max_false_hit_rate: float) -> float:
        for row in self.rows:
            if row.false_hit_upper <= max_false_hit_rate:
                return row.threshold
        return NEVER

    def row_at(self, threshold: float) -> CalibrationRow | None:
        return _row_at(self.rows, threshold)

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": ["threshold", "false_hits", "negatives", "true_hits", "positives"],
            "rows": [r.as_list() for r in self.rows],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CalibrationTable:
        return cls(
            _increasing(
                tuple(
                    CalibrationRow(float(t), int(fh), int(n), int(th), int(p))
                    for t, fh, n, th, p in data["rows"]
                )
            )
        )


@dataclass(frozen=True, slots=True)
class PrecisionRow:
    threshold: float
    hits: int  # statement pairs accepted
    true_hits: int  # of them, same-meaning pairs (label 1)
    positives: int

    @property
    def precision(self) -> float:
        return self.true_hits / self.hits if self.hits else 1.0

    @property
    def recall(self) -> float:
        return self.true_hits / self.positives if self.positives else 0.0

    def as_list(self) -> list[float | int]:
        return [self.threshold, self.hits, self.true_hits, self.positives]


@dataclass(frozen=True)
class PrecisionTable:
    rows: tuple[PrecisionRow, ...]  # increasing threshold

    @classmethod
    def from_scores(
        cls, scores: Sequence[float], labels: Sequence[int], thresholds: Sequence[float]
    ) -> PrecisionTable:
        positives = sum(1 for y in labels if y == 1)
        rows = []
        for t in sorted(thresholds):
            hits = [y for s, y in zip(scores, labels, strict=True) if s >= t]
            rows.append(PrecisionRow(round(float(t), 4), len(hits), sum(hits), positives))
        return cls(tuple(rows))

    def threshold_for(self, min_precision: float) -> float:
        for row in self.rows:
            if row.hits >= MIN_PRECISION_HITS and row.precision >= min_precision:
                return row.threshold
        return NEVER

    def row_at(self, threshold: float) -> PrecisionRow | None:
        return _row_at(self.rows, threshold)

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": ["threshold", "hits", "true_hits", "positives"],
            "rows": [r.as_list() for r in self.rows],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrecisionTable:
        return cls(
            _increasing(
                tuple(
                    PrecisionRow(float(t), int(h), int(th), int(p)) for t, h, th, p in data["rows"]
                )
            )
        )
