"""What the request path needs of a router's calibration: the routing comparison and the table.

A router gives each request a score (higher: the large model is more worth its cost) and sends
it to the large tier when ``score >= threshold`` (``wants_large``: the one comparison the server
and every evaluation share). A ``CalibrationTable`` keeps the router's curve at 101 large
fractions (0 %, 1 %, ..., 100 %) so the gateway can turn a target (``max_large_fraction``,
``min_quality_recovered``) into a threshold at start-up without the labelled data. How the
curve and the table are computed: ``routing/training/curves.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from policies.models import CalibrationTarget

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

EPS = 1e-9


@overload
def wants_large(score: float, threshold: float) -> bool: ...
@overload
def wants_large(score: FloatArray, threshold: float) -> BoolArray: ...
def wants_large(score: float | FloatArray, threshold: float) -> bool | BoolArray:
    """The routing comparison, shared by the request path and every evaluation."""
    if isinstance(score, np.ndarray):
        return np.greater_equal(score, threshold)
    return bool(score >= threshold)


@dataclass(frozen=True)
class CalibrationTable:
    """Threshold and PGR at large fractions 0, 0.01, ..., 1 of a labelled (dev) set."""

    large_fraction: tuple[float, ...]
    threshold: tuple[float, ...]
    pgr: tuple[float, ...]

    def threshold_for(self, target: CalibrationTarget) -> float:
        if target.kind == "max_large_fraction":
            best = 0
            for i, x in enumerate(self.large_fraction):
                if x <= target.value + EPS:
                    best = i
            return self.threshold[best]
        for i, value in enumerate(self.pgr):
            if value >= target.value - EPS:
                return self.threshold[i]
        return self.threshold[-1]

    def to_json(self) -> dict[str, list[float]]:
        return {
            "large_fraction": list(self.large_fraction),
            "threshold": list(self.threshold),  # exact: a threshold may sit just above a score
            "pgr": [round(v, 4) for v in self.pgr],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CalibrationTable:
        table = cls(
            tuple(float(v) for v in data["large_fraction"]),
            tuple(float(v) for v in data["threshold"]),
            tuple(float(v) for v in data["pgr"]),
        )
        if not (len(table.large_fraction) == len(table.threshold) == len(table.pgr) > 0):
            raise ValueError("calibration table columns differ in length")
        return table
