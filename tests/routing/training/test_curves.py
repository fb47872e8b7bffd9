"""Router curves, APGR/CPT and target calibration on sets whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from policies.models import CalibrationTarget
from routing.calibration import CalibrationTable, wants_large
from routing.training.curves import (
    apgr,
    calibrate,
    cpt,
    parse_target,
    router_curve,
    table_from_scores,
    threshold_for_large_fraction,
    threshold_for_quality_recovered,
)
from routing.training.router_eval import ScoredRows, evaluation, figures, random_figures

# Four requests: A and B only the large tier answers, C both answer, D neither.
# small quality 0.25, large quality 0.75, gap 0.5.
SMALL = [0, 0, 1, 0]
LARGE = [1, 1, 1, 0]
PERFECT = [4.0, 3.0, 2.0, 1.0]


def test_perfect_router_curve_and_apgr() -> None:
    curve = router_curve(PERFECT, SMALL, LARGE)
    assert curve.large_fraction.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert curve.quality.tolist() == pytest.approx([0.25, 0.5, 0.75, 0.75, 0.75])
    assert curve.pgr.tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])
    # trapezoids of width 0.25: 0.0625 + 0.1875 + 0.25 + 0.25
    assert apgr(curve) == pytest.approx(0.75)
    assert cpt(curve, 0.5) == pytest.approx(0.25)
    assert cpt(curve, 0.75) == pytest.approx(0.375)  # halfway between 0.25 and 0.5
    assert cpt(curve, 0.8) == pytest.approx(0.4)


def test_worst_router_is_below_the_diagonal() -> None:
    curve = router_curve([-s for s in PERFECT], SMALL, LARGE)
    assert apgr(curve) == pytest.approx(0.25)
    assert cpt(curve, 0.5) == pytest.approx(0.75)


def test_ties_move_together_and_give_the_straight_line() -> None:
    curve = router_curve([0.3, 0.3, 0.3, 0.3], SMALL, LARGE)
    assert curve.large_fraction.tolist() == [0.0, 1.0]
    assert apgr(curve) == pytest.approx(0.5)


def test_random_router_averages_one_half() -> None:
    rng = np.random.default_rng(7)
    small = (rng.random(400) < 0.6).astype(float)
    large = (rng.random(400) < 0.85).astype(float)
    values = [apgr(router_curve(rng.random(400), small, large)) for _ in range(200)]
    assert np.mean(values) == pytest.approx(0.5, abs=0.02)
    baseline = random_figures(small, large, large_fraction=0.3)
    assert baseline.apgr == pytest.approx(0.5, abs=0.03)
    assert baseline.quality == pytest.approx(small.mean() + 0.3 * (large.mean() - small.mean()))


def test_pgr_undefined_when_tiers_are_equal() -> None:
    with pytest.raises(ValueError, match="PGR"):
        _ = router_curve([1.0, 2.0], [1, 0], [0, 1]).pgr


def test_threshold_for_large_fraction() -> None:
    scores = np.arange(1, 11) / 10  # 0.1 ... 1.0
    threshold = threshold_for_large_fraction(scores, 0.3)
    assert threshold == pytest.approx(0.8)
    assert wants_large(scores, threshold).mean() == pytest.approx(0.3)
    assert threshold_for_large_fraction(scores, 0.35) == pytest.approx(0.8)  # never above 35 %
    assert threshold_for_large_fraction(scores, 1.0) == pytest.approx(0.1)
    nothing = threshold_for_large_fraction(scores, 0.0)
    assert not wants_large(scores, nothing).any()


def test_threshold_for_large_fraction_never_splits_a_tie() -> None:
    scores = [1.0, 1.0, 1.0, 0.5]
    threshold = threshold_for_large_fraction(scores, 0.5)
    assert not wants_large(np.array(scores), threshold).any()
    assert threshold_for_large_fraction(scores, 0.75) == 1.0


def test_threshold_for_quality_recovered() -> None:
    assert threshold_for_quality_recovered(PERFECT, SMALL, LARGE, 0.5) == 4.0
    assert threshold_for_quality_recovered(PERFECT, SMALL, LARGE, 0.8) == 3.0
    assert threshold_for_quality_recovered(PERFECT, SMALL, LARGE, 1.0) == 3.0
    # the worst router needs three large calls for PGR 0.5
    worst = [-s for s in PERFECT]
    assert threshold_for_quality_recovered(worst, SMALL, LARGE, 0.5) == -3.0
    with pytest.raises(ValueError, match="not reached"):
        threshold_for_quality_recovered(PERFECT, SMALL, LARGE, 1.5)


def test_calibrate_dispatches_on_the_target() -> None:
    assert calibrate(CalibrationTarget("max_large_fraction", 0.5), PERFECT) == 3.0
    assert calibrate(CalibrationTarget("min_quality_recovered", 0.5), PERFECT, SMALL, LARGE) == 4.0
    with pytest.raises(ValueError, match="labels"):
        calibrate(CalibrationTarget("min_quality_recovered", 0.5), PERFECT)


def test_calibration_table_matches_the_exact_thresholds() -> None:
    rng = np.random.default_rng(3)
    scores = rng.permutation(np.arange(200)) / 200.0
    small = (rng.random(200) < 0.5).astype(float)
    large = np.maximum(small, (scores > 0.5).astype(float))
    table = table_from_scores(scores, small, large)
    assert len(table.threshold) == 101
    for fraction in (0.0, 0.1, 0.3, 0.55, 1.0):
        target = CalibrationTarget("max_large_fraction", fraction)
        assert table.threshold_for(target) == pytest.approx(calibrate(target, scores))
    target = CalibrationTarget("min_quality_recovered", 0.8)
    exact = calibrate(target, scores, small, large)
    # the table resolves to a grid point at or below the exact one: PGR still reaches the target
    assert table.threshold_for(target) <= exact + 1e-12
    restored = CalibrationTable.from_json(table.to_json())
    assert restored.threshold == table.threshold
    assert restored.pgr == pytest.approx(table.pgr, abs=1e-4)


def test_parse_target() -> None:
    assert parse_target("max_large_fraction=0.3") == CalibrationTarget("max_large_fraction", 0.3)
    assert str(parse_target("min_quality_recovered=0.8")) == "min_quality_recovered=0.8"
    for bad in (
        "max_large_fraction",
        "quality=0.8",
        "max_large_fraction=abc",
        "min_quality_recovered=1.5",
    ):
        with pytest.raises(ValueError, match=r"target|number|lie in"):
            parse_target(bad)


def test_wants_large_boundary_goes_large() -> None:
    assert wants_large(0.2, 0.2) is True
    assert wants_large(0.19, 0.2) is False
    assert wants_large(np.array([0.1, 0.2, 0.3]), 0.2).tolist() == [False, True, True]


def test_evaluation_reports_the_documented_keys() -> None:
    scored = ScoredRows(
        small=np.array(SMALL, dtype=float),
        large=np.array(LARGE, dtype=float),
        scores=np.array(PERFECT),
        to_large=np.array(PERFECT) >= 3.0,
        threshold=3.0,
        skipped=1,
        cross_validated=True,
    )
    ours = figures(scored)
    assert ours.apgr == pytest.approx(0.75)
    assert ours.large_fraction == pytest.approx(0.5)
    assert ours.quality == pytest.approx(0.75)
    result = evaluation(scored, "cascade", "x.jsonl")
    assert {"apgr", "cpt50", "cpt80", "large_fraction", "quality"} <= set(result)
    assert result["escalation_fraction"] == result["large_fraction"] == 0.5
    assert result["skipped"] == 1
    assert result["random"]["large_fraction"] == 0.5
