from __future__ import annotations

import pytest

from cache.calibration import (
    MIN_PRECISION_HITS,
    NEVER,
    CalibrationTable,
    PrecisionTable,
    wilson,
    wilson_upper,
)


def test_wilson_known_values() -> None:
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    # Zero false hits in 360 near misses still bounds the rate only at ~0.75% (one-sided 95%).
    assert wilson_upper(0, 360) == pytest.approx(0.00746, abs=1e-4)
    assert wilson_upper(1, 360) > 0.01
    assert wilson(0, 0) == (0.0, 1.0)


def test_threshold_for_picks_the_lowest_threshold_within_the_bound() -> None:
    # Near misses score 0.1..0.5 and one at 0.85; paraphrases 0.6..0.95.
    scores = [0.1, 0.2, 0.3, 0.4, 0.5, 0.85] * 100 + [0.6, 0.7, 0.8, 0.9, 0.95] * 40
    labels = [0] * 600 + [1] * 200
    table = CalibrationTable.from_scores(scores, labels, [0.3, 0.55, 0.75, 0.86, 0.99])
    # At 0.55 the 100 pairs at 0.85 are false hits (1/6); at 0.86 none are.
    assert table.threshold_for(0.01) == 0.86
    assert table.threshold_for(0.2) == 0.55
    row = table.row_at(0.86)
    assert row is not None and row.false_hits == 0 and row.recall == pytest.approx(0.4)
    # A bound no threshold can promise: nothing is served.
    assert table.threshold_for(0.001) == NEVER
    assert CalibrationTable.from_json(table.to_json()) == table


def test_calibration_rows_must_increase() -> None:
    with pytest.raises(ValueError, match="increasing"):
        CalibrationTable.from_json({"rows": [[0.5, 0, 10, 1, 10], [0.4, 0, 10, 1, 10]]})


def test_precision_table_picks_the_lowest_threshold_reaching_the_target() -> None:
    # 20 paraphrases at 0.995, 100 at 0.99, 100 at 0.9 with 5 non-paraphrases beside them,
    # 100 non-paraphrases at 0.5.
    scores = [0.995] * 20 + [0.99] * 100 + [0.9] * 105 + [0.5] * 100
    labels = [1] * 20 + [1] * 100 + [1] * 100 + [0] * 5 + [0] * 100
    table = PrecisionTable.from_scores(scores, labels, [0.4, 0.8, 0.95, 0.992])
    assert table.threshold_for(0.97) == 0.8  # 220 of 225 hits right: 0.978
    assert table.threshold_for(0.98) == 0.95  # 0.978 < 0.98; at 0.95 120 of 120
    assert table.threshold_for(0.7) == 0.8 and table.threshold_for(0.6) == 0.4  # 220 of 325
    row = table.row_at(0.8)
    assert row is not None and (row.hits, row.true_hits) == (225, 220)
    assert row.recall == pytest.approx(220 / 220)
    assert PrecisionTable.from_json(table.to_json()) == table
    # 20 right hits are fewer than MIN_PRECISION_HITS: they back nothing on their own.
    few = PrecisionTable.from_scores(scores[:20] + [0.5] * 50, [1] * 20 + [0] * 50, [0.9])
    assert MIN_PRECISION_HITS > 20 and few.threshold_for(0.9) == NEVER
