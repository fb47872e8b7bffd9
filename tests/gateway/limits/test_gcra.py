"""GCRA in integers: the burst, the refill, the waits, reconciliation."""

from __future__ import annotations

import pytest

from gateway.limits import gcra


def test_a_burst_from_idle_takes_exactly_the_limit() -> None:
    rate, bucket = gcra.Rate(20), gcra.Bucket()
    results = [gcra.take(bucket, rate, 1, 1_000) for _ in range(60)]
    assert results.count(0) == 20
    # The 21st waits one unit's refill: 60 s / 20 = 3 s.
    assert results[20] == 3_000


def test_capacity_comes_back_one_unit_per_period_over_limit() -> None:
    rate, bucket = gcra.Rate(20), gcra.Bucket()
    for _ in range(20):
        assert gcra.take(bucket, rate, 1, 0) == 0
    assert gcra.take(bucket, rate, 1, 2_999) == 1  # one millisecond short
    assert gcra.take(bucket, rate, 1, 3_000) == 0
    assert gcra.take(bucket, rate, 1, 3_000) == 3_000
    # A whole period later the full burst is back.
    assert [gcra.take(bucket, rate, 1, 63_000) for _ in range(21)].count(0) == 20


def test_over_any_interval_admits_at_most_limit_plus_the_rate() -> None:
    rate, bucket = gcra.Rate(7), gcra.Bucket()  # 60000 / 7 ms per unit: not a whole number
    admitted = [t for t in range(0, 180_000, 250) if gcra.take(bucket, rate, 1, t) == 0]
    for span in (1_000, 8_571, 30_000, 60_000):
        bound = 7 + span * 7 // 60_000
        for start in range(0, 180_000, 250):
            assert sum(1 for t in admitted if start <= t < start + span) <= bound
    # Over the whole run: the burst plus the rate, not a unit more or less.
    assert len(admitted) == 7 + 180_000 * 7 // 60_000 - 1


def test_remaining_and_reset() -> None:
    rate, bucket = gcra.Rate(10), gcra.Bucket()
    assert gcra.remaining(0, rate) == 10 and gcra.reset_ms(0, rate) == 0
    for _ in range(4):
        gcra.take(bucket, rate, 1, 0)
    assert gcra.remaining(bucket.debt, rate) == 6
    assert gcra.reset_ms(bucket.debt, rate) == 24_000  # 4 units x 6 s
    later = gcra.debt_at(bucket, rate, 6_000)
    assert gcra.remaining(later, rate) == 7 and gcra.reset_ms(later, rate) == 18_000


def test_tokens_variable_amounts_and_never_for_more_than_the_limit() -> None:
    rate, bucket = gcra.Rate(1_000), gcra.Bucket()
    assert gcra.take(bucket, rate, 600, 0) == 0
    assert gcra.take(bucket, rate, 500, 0) == 6_000  # 100 tokens short: 100 x 60 ms
    assert gcra.take(bucket, rate, 400, 0) == 0
    assert gcra.take(bucket, rate, 1_001, 120_000) is None  # can never fit


def test_reconcile_gives_back_and_charges_extra() -> None:
    rate, bucket = gcra.Rate(1_000), gcra.Bucket()
    assert gcra.take(bucket, rate, 900, 0) == 0
    gcra.adjust(bucket, rate, -800, 0)  # used 100 of the 900 reserved
    assert gcra.remaining(gcra.debt_at(bucket, rate, 0), rate) == 900
    gcra.adjust(bucket, rate, 1_500, 0)  # used far more than reserved: over the limit
    debt = gcra.debt_at(bucket, rate, 0)
    assert gcra.remaining(debt, rate) == 0
    assert gcra.wait_ms(debt, rate, 1) == 36_060  # 600 over + 1, at 60 ms per token
    gcra.adjust(bucket, rate, -10_000, 0)
    assert bucket.debt == 0  # never below zero


def test_a_clock_that_goes_back_drains_nothing() -> None:
    rate, bucket = gcra.Rate(10), gcra.Bucket()
    gcra.take(bucket, rate, 1, 10_000)
    assert gcra.debt_at(bucket, rate, 5_000) == bucket.debt
    gcra.take(bucket, rate, 1, 5_000)
    assert bucket.at_ms == 10_000


def test_rate_bounds() -> None:
    with pytest.raises(ValueError, match="limit"):
        gcra.Rate(0)
    with pytest.raises(ValueError, match="limit"):
        gcra.Rate(gcra.MAX_LIMIT + 1)
    assert gcra.Rate(gcra.MAX_LIMIT).capacity < 2**53
