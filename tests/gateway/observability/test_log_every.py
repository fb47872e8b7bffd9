"""``LogEvery``: a warning that repeats per request is written once per key and period, and
the next line says how many were left out."""

from __future__ import annotations

import logging

import pytest

from gateway.observability.log_every import MAX_KEYS, LogEvery


def test_one_line_per_key_and_period_then_the_count_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    every = LogEvery(logging.getLogger("test.log_every"), period_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "test.log_every"):
        assert every.warning("a", "replica %s failed", "r1")
        for _ in range(5):
            now[0] += 1.0
            assert not every.warning("a", "replica %s failed", "r1")
        assert every.warning("b", "replica %s failed", "r2")  # another key: its own line
        now[0] += 5.0  # 10 s after the first line of "a"
        assert every.warning("a", "replica %s failed", "r1")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "replica r1 failed",
        "replica r2 failed",
        "replica r1 failed (and 5 more like it in the last 10 s)",
    ]


def test_keys_are_bounded() -> None:
    every = LogEvery(logging.getLogger("test.log_every.bounded"), clock=lambda: 0.0)
    for key in range(MAX_KEYS * 3):
        every.warning(key, "x")
    assert len(every._seen) == MAX_KEYS
