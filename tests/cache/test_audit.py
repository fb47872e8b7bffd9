"""The production audit's rules: comparing answers, the per-minute bound, tightening."""

from __future__ import annotations

import json

import pytest

from cache.audit import AuditBook, answer_text, answers_agree, needs_exact, tighter_threshold
from cache.calibration import NEVER, CalibrationTable, PrecisionTable


def chat(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def test_answer_text_reads_chat_and_completions() -> None:
    assert answer_text(chat("Paris")) == "Paris"
    assert answer_text(json.dumps({"choices": [{"text": "ok"}]}).encode()) == "ok"
    assert answer_text(b"not json") is None
    assert answer_text(json.dumps({"choices": []}).encode()) is None


def test_short_and_structured_answers_must_match_exactly() -> None:
    assert answers_agree("Paris.", "paris", None, 0.8)
    assert not answers_agree("42", "41", 0.99, 0.8)  # embeddings close, answers different
    assert needs_exact('{"a": 1}', "x " * 40)
    long_a = "Water boils at one hundred degrees Celsius at sea level, lower at altitude. " * 2
    long_b = (
        "At sea level water boils at 100 C; on a mountain it boils at a lower temperature. " * 2
    )
    assert answers_agree(long_a, long_b, 0.9, 0.8)
    assert not answers_agree(long_a, long_b, 0.5, 0.8)


def test_per_minute_bound() -> None:
    book = AuditBook()
    assert book.take(2, 0.0) and book.take(2, 1.0)
    assert not book.take(2, 2.0)
    assert book.take(2, 61.0)  # the first left the one-minute window
    assert (book.sent, book.skipped) == (3, 1)


def table() -> CalibrationTable:
    scores = [0.1] * 300 + [0.5] * 60 + [0.7, 0.8, 0.95] * 80
    labels = [0] * 360 + [1] * 240
    return CalibrationTable.from_scores(scores, labels, [0.2, 0.4, 0.6, 0.75, 0.9, 0.99])


def test_tightens_on_a_false_hit_above_the_bound_and_never_loosens() -> None:
    book = AuditBook()
    calibration = table()
    shipped = calibration.threshold_for(0.01)
    assert shipped == 0.6
    for _ in range(20):
        assert book.record("faq", True, shipped, 0.01, calibration) is None  # no false hit yet
    raised = book.record("faq", False, shipped, 0.01, calibration)
    assert raised is not None and raised > shipped
    state = book.namespaces["faq"]
    assert (state.audited, state.false_hits, state.tightenings) == (21, 1, 1)
    # Agreeing audits after it never lower the threshold; a new false hit raises it again.
    assert book.record("faq", True, raised, 0.01, calibration) is None
    again = book.record("faq", False, raised, 0.01, calibration)
    assert again is not None and again > raised
    assert book.namespaces["faq"].summary()["upper95"] > 0.01
    assert "other" not in book.namespaces


def test_tighter_threshold_steps_up_and_tops_out() -> None:
    calibration = table()
    assert tighter_threshold(0.6, calibration) == 0.75
    assert tighter_threshold(0.74, calibration) == 0.9  # at least one step (0.02) up
    assert tighter_threshold(0.99, calibration) == NEVER
    assert tighter_threshold(0.5, None) == NEVER
    with pytest.raises(KeyError):
        AuditBook().namespaces["missing"]


def test_statement_hits_step_along_their_own_table() -> None:
    scores = [0.99] * 200 + [0.95] * 100 + [0.9] * 100
    labels = [1] * 200 + [1] * 98 + [0] * 2 + [1] * 80 + [0] * 20
    statements = PrecisionTable.from_scores(scores, labels, [0.9, 0.93, 0.96, 0.98])
    shipped = statements.threshold_for(0.98)
    assert shipped == 0.93
    book = AuditBook()
    # Bound 1 - min_precision = 0.02: one false hit in 10 audits is above it.
    for _ in range(9):
        assert book.record("faq/statements", True, shipped, 0.02, statements) is None
    assert book.record("faq/statements", False, shipped, 0.02, statements) == 0.96
    assert tighter_threshold(0.96, statements) == 0.98
    assert "faq" not in book.namespaces  # the namespace's request hits are kept apart
