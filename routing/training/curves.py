"""Router quality curves (PGR, APGR, CPT) and turning a target into a threshold.

A router gives each request a score (higher: the large model is more worth its cost) and sends
it to the large tier when ``score >= threshold`` (``wants_large``: the one comparison the server
and the evaluation share). Sweeping the threshold from above the highest score down to the
lowest traces the router's curve over a labelled set:

* x: the fraction of requests sent to the large model;
* quality: mean correctness, each request scored by the tier it was sent to;
* PGR (performance gap recovered) = (quality - small) / (large - small), where small and large
  are the qualities of sending everything to one tier (RouteLLM, Ong et al. 2024).

Requests with equal scores move together, so the curve has one point per distinct score and is
linear between them (the expected curve under random tie-breaking). From the curve:

* APGR: the area under PGR over x in [0, 1] (trapezoid over every point; RouteLLM samples ten
  thresholds, which differs only in resolution). A random router has expected APGR 0.5.
* CPT(p): the smallest large fraction whose PGR reaches p (linear between points).

Calibration (RouteLLM's ``calibrate_threshold``, extended to a quality target): a policy states
either a threshold or a target, and a target becomes a threshold on labelled data:

* ``max_large_fraction=f``: the lowest threshold sending at most a fraction f of the requests
  to the large tier (ties never push the fraction above f);
* ``min_quality_recovered=p``: the highest threshold whose PGR reaches p (fewest large calls).

``table_from_scores`` builds the ``CalibrationTable`` an artifact ships (routing/calibration.py):
the curve at 101 large fractions, so the gateway resolves a target at start-up without the
labelled data; ``llm-gateway calibrate`` computes the exact threshold on a user's own data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.models import CALIBRATION_KINDS, CalibrationTarget
from routing.calibration import EPS, CalibrationTable

FloatArray = npt.NDArray[np.float64]


def above(value: float) -> float:
    """The next float above ``value``: a threshold that sends none of the scores <= value."""
    return float(np.nextafter(value, math.inf))


def parse_target(text: str) -> CalibrationTarget:
    """``max_large_fraction=0.3`` or ``min_quality_recovered=0.8``."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or name not in CALIBRATION_KINDS:
        raise ValueError(
            f"target must be one of {', '.join(CALIBRATION_KINDS)} as NAME=VALUE: {text!r}"
        )
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"target value is not a number: {raw!r}") from exc
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return CalibrationTarget(name, value)


@dataclass(frozen=True)
class RouterCurve:
    """The curve at its breakpoints, from 'no large call' (index 0) to 'all large' (last)."""

    thresholds: FloatArray  # route to large iff score >= thresholds[i]
    large_fraction: FloatArray
    quality: FloatArray
    small_quality: float
    large_quality: float

    @property
    def pgr(self) -> FloatArray:
        gap = self.large_quality - self.small_quality
        if abs(gap) < EPS:
            raise ValueError("the two tiers have equal quality on this data: PGR is undefined")
        result: FloatArray = (self.quality - self.small_quality) / gap
        return result


def _as_float(values: Any) -> FloatArray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def router_curve(scores: Any, small_correct: Any, large_correct: Any) -> RouterCurve:
    s = _as_float(scores)
    small = _as_float(small_correct)
    large = _as_float(large_correct)
    if not (len(s) == len(small) == len(large)) or len(s) == 0:
        raise ValueError("scores and labels must be non-empty and of equal length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    n = len(s)
    order = np.argsort(-s, kind="stable")
    sorted_scores = s[order]
    gains = (large - small)[order]
    # Last index of each group of equal scores: a threshold at that score sends the whole group.
    group_ends = np.nonzero(np.diff(sorted_scores) != 0)[0]
    ends = np.concatenate([group_ends, [n - 1]])
    cumulative = np.cumsum(gains)
    small_quality = float(small.mean())
    large_fraction = np.concatenate([[0.0], (ends + 1) / n])
    quality = np.concatenate([[small_quality], small_quality + cumulative[ends] / n])
    thresholds = np.concatenate([[above(float(sorted_scores[0]))], sorted_scores[ends]])
    return RouterCurve(thresholds, large_fraction, quality, small_quality, float(large.mean()))


def apgr(curve: RouterCurve) -> float:
    return float(np.trapezoid(curve.pgr, curve.large_fraction))


def cpt(curve: RouterCurve, level: float) -> float | None:
    """The smallest large fraction reaching PGR ``level`` (None if the curve never does)."""
    pgr = curve.pgr
    hits = np.nonzero(pgr >= level - EPS)[0]
    if len(hits) == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return 0.0
    x0, x1 = curve.large_fraction[i - 1], curve.large_fraction[i]
    y0, y1 = pgr[i - 1], pgr[i]
    return float(x0 + (x1 - x0) * (level - y0) / (y1 - y0))


def threshold_for_large_fraction(scores: Any, max_fraction: float) -> float:
    s = _as_float(scores)
    if len(s) == 0:
        raise ValueError("no scores to calibrate on")
    values = np.unique(s)[::-1]  # distinct scores, highest first
    counts = np.searchsorted(np.sort(-s), -values, side="right")  # scores >= each value
    allowed = np.nonzero(counts <= max_fraction * len(s) + EPS)[0]
    if len(allowed) == 0:
        return above(float(values[0]))
    return float(values[allowed[-1]])


def threshold_for_quality_recovered(
    scores: Any, small_correct: Any, large_correct: Any, min_pgr: float
) -> float:
    curve = router_curve(scores, small_correct, large_correct)
    hits = np.nonzero(curve.pgr >= min_pgr - EPS)[0]
    if len(hits) == 0:
        raise ValueError(f"PGR {min_pgr} is not reached on this data")
    return float(curve.thresholds[int(hits[0])])


def calibrate(
    target: CalibrationTarget, scores: Any, small_correct: Any = None, large_correct: Any = None
) -> float:
    if target.kind == "max_large_fraction":
        return threshold_for_large_fraction(scores, target.value)
    if small_correct is None or large_correct is None:
        raise ValueError("min_quality_recovered needs small_correct and large_correct labels")
    return threshold_for_quality_recovered(scores, small_correct, large_correct, target.value)


GRID_POINTS = 101


def table_from_scores(scores: Any, small_correct: Any, large_correct: Any) -> CalibrationTable:
    curve = router_curve(scores, small_correct, large_correct)
    pgr = curve.pgr
    fractions: list[float] = []
    thresholds: list[float] = []
    recovered: list[float] = []
    for x in np.linspace(0.0, 1.0, GRID_POINTS):
        # The breakpoint with the largest fraction not above x (the table never overshoots).
        i = int(np.searchsorted(curve.large_fraction, x + EPS, side="right") - 1)
        fractions.append(round(float(x), 4))
        thresholds.append(float(curve.thresholds[i]))
        recovered.append(float(pgr[i]))
    return CalibrationTable(tuple(fractions), tuple(thresholds), tuple(recovered))
