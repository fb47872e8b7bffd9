"""The gate's two calibration tables and its out-of-fold figures, from stored scores.

Every figure here follows from out-of-fold scores (``cache.training.train_gate`` computes
them and stores them in the artifact) and the dev files' labels, so ``--recalibrate`` and the
artifact's test can rebuild the tables and figures from the artifact alone:

* the request table (``CalibrationTable``): each near-miss pair's worst request-gate score
  over the calibrating splits (topic, plain, kind: its highest for a near miss, its lowest
  for a paraphrase); ``max_false_hit_rate`` picks its threshold;
* the statement table (``PrecisionTable``): the dev statement pairs' out-of-fold statement
  scores (topic-disjoint dev folds); ``min_precision`` picks its threshold;
* the figures of each split at the default operating point, with both gates as the runtime
  runs them: a statement pair is a hit when its statement score reaches the statement
  threshold, any other pair when its request score reaches the request threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.calibration import CalibrationTable, PrecisionTable, wilson
from cache.training.statement_model import STATEMENT_THRESHOLDS
from cache.verifier import DEFAULT_MAX_FALSE_HIT_RATE, DEFAULT_MIN_PRECISION

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

CALIBRATING = ("topic", "plain", "kind")
REQUEST_THRESHOLDS = tuple(
    sorted(
        {
            round(float(t), 4)
            for t in [
                *np.arange(0.02, 0.96, 0.02),
                *np.arange(0.96, 0.999, 0.002),
                *np.arange(0.999, 1.0, 0.0002),
            ]
        }
    )
)


@dataclass(frozen=True)
class Pairs:
    """What the figures need of the labelled pairs: origin (dev, nearmiss, ...), kind, label
    and whether each is a statement pair."""

    origin: npt.NDArray[np.str_]
    source: npt.NDArray[np.str_]
    label: npt.NDArray[np.int64]
    statement: Mask

    def to_json(self) -> dict[str, list[Any]]:
        """Per pair, in order: what the artifact keeps so that its figures can be recomputed
        without the dev files (labels and kinds only, never the texts)."""
        return {
            "origin": self.origin.tolist(),
            "source": self.source.tolist(),
            "label": self.label.tolist(),
            "statement": self.statement.tolist(),
        }

    @classmethod
    def from_json(cls, data: dict[str, list[Any]]) -> Pairs:
        return cls(
            np.array(data["origin"], dtype=np.str_),
            np.array(data["source"], dtype=np.str_),
            np.array(data["label"], dtype=np.int64),
            np.array(data["statement"], dtype=bool),
        )


@dataclass(frozen=True)
class Calibrated:
    calibrating: list[str]
    requests: CalibrationTable
    statements: PrecisionTable
    report: dict[str, Any]


def hits(
    pairs: Pairs, request: Floats, statement: Floats, t_request: float, t_statement: float
) -> tuple[Mask, Mask]:
    """(scored, hit) per pair: statement pairs by their statement score, others by their
    request score; NaN: not scored in this split."""
    score = np.where(pairs.statement, statement, request)
    bar = np.where(pairs.statement, t_statement, t_request)
    scored = ~np.isnan(score)
    return scored, scored & (np.nan_to_num(score, nan=-1.0) >= bar)


def calibrate(pairs: Pairs, request: dict[str, Floats], statement: dict[str, Floats]) -> Calibrated:
    if "topic" not in request:
        raise SystemExit("the calibration needs the topic scheme")
    near = pairs.origin == "nearmiss"
    calibrating = [s for s in CALIBRATING if s in request]
    stacked = np.stack([request[s][near] for s in calibrating])
    worst = np.where(pairs.label[near] == 0, stacked.max(axis=0), stacked.min(axis=0))
    requests = CalibrationTable.from_scores(
        worst.tolist(), pairs.label[near].tolist(), REQUEST_THRESHOLDS
    )
    dev = pairs.statement & (pairs.origin == "dev") & ~np.isnan(statement["topic"])
    statements = PrecisionTable.from_scores(
        statement["topic"][dev].tolist(), pairs.label[dev].tolist(), STATEMENT_THRESHOLDS
    )
    t_request = requests.threshold_for(DEFAULT_MAX_FALSE_HIT_RATE)
    t_statement = statements.threshold_for(DEFAULT_MIN_PRECISION)
    # Dev pairs have figures in the topic split only (the statement gate's folds).
    other = pairs.origin != "dev"
    report = {
        s: figures(
            pairs,
            *hits(
                pairs,
                request[s] if s == "topic" else np.where(other, request[s], np.nan),
                statement[s] if s == "topic" else np.where(other, statement[s], np.nan),
                t_request,
                t_statement,
            ),
        )
        | {"threshold": t_request, "statement_threshold": t_statement}
        for s in request
    }
    return Calibrated(calibrating, requests, statements, report)


def figures(pairs: Pairs, scored: Mask, hit: Mask) -> dict[str, Any]:
    """Near-miss false-hit rate (overall, per kind), paraphrase recall, dev precision/recall,
    and how many hits each gate made."""
    out: dict[str, Any] = {}
    near = scored & (pairs.origin == "nearmiss")
    if near.any():
        neg, pos = near & (pairs.label == 0), near & (pairs.label == 1)
        out["nearmiss"] = {
            "false_hit_rate": rate(int((hit & neg).sum()), int(neg.sum())),
            "paraphrase_recall": rate(int((hit & pos).sum()), int(pos.sum())),
            "by_source": {
                s: rate(
                    int((hit & near & (pairs.source == s)).sum()),
                    int((near & (pairs.source == s)).sum()),
                )
                for s in sorted(set(pairs.source[near]))
            },
            "statement_pairs": rate(
                int((hit & near & pairs.statement).sum()), int((near & pairs.statement).sum())
            ),
        }
    dev = scored & (pairs.origin == "dev")
    if dev.any():
        true = hit & dev & (pairs.label == 1)
        out["dev"] = {
            "precision": rate(int(true.sum()), int((hit & dev).sum())),
            "recall": rate(int(true.sum()), int((dev & (pairs.label == 1)).sum())),
            "by_gate": {
                kind: {
                    "precision": rate(int((true & part).sum()), int((hit & dev & part).sum())),
                    "pairs": int((dev & part).sum()),
                }
                for kind, part in (("statement", pairs.statement), ("request", ~pairs.statement))
            },
        }
    return out


def rate(k: int, n: int) -> dict[str, Any]:
    low, high = wilson(k, n)
    return {
        "n": n,
        "hits": k,
        "rate": round(k / n, 4) if n else 0.0,
        "ci95": [round(low, 4), round(high, 4)],
    }


def stored_scores(
    pairs: Pairs, metadata: dict[str, Any]
) -> tuple[dict[str, Floats], dict[str, Floats]]:
    """Request and statement scores per split, over all pairs (dev first, then near-miss),
    from an artifact's ``out_of_fold_scores`` and ``statement_scores``."""
    dev, near = pairs.origin == "dev", pairs.origin == "nearmiss"
    stored, statement_stored = metadata["out_of_fold_scores"], metadata["statement_scores"]
    request: dict[str, Floats] = {}
    statement: dict[str, Floats] = {}
    for key, scores in stored.items():
        if not key.startswith("nearmiss_"):
            continue
        scheme = key.removeprefix("nearmiss_")
        r = np.full(len(pairs.label), np.nan)
        r[near] = scores
        s = np.full(len(pairs.label), np.nan)
        s[near & pairs.statement] = statement_stored[key]
        if scheme == "topic":
            r[dev] = stored["dev_topic"]
            s[dev & pairs.statement] = statement_stored["dev_topic"]
        request[scheme], statement[scheme] = r, s
    return request, statement
