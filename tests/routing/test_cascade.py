"""Cascade verifier: answer signals, keep and escalate decisions, reasons, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from routing.cascade import (
    CASCADE_FEATURES,
    LOGPROB_FEATURES,
    CascadeVerifier,
    SmallAnswer,
    answer_signals,
    count_arithmetic_errors,
    final_answer,
    load_verifier,
)
from routing.training.router_data import LabelledRow
from routing.training.train_router import cascade_design, cascade_features, fit_cascade

GOOD = "He runs 3 x 60 = <<3*60=180>>180 meters per session.\nSo 180 * 3 = 540 meters.\n#### 540"
BAD_MATH = (
    "He runs 3 x 60 = <<3*60=190>>190 meters per session.\nSo 190 * 3 = 560 meters.\n#### 560"
)
NO_FINAL = "He runs 3 x 60 = 180 meters per session, and so on for the week"


def test_final_answer_forms() -> None:
    assert final_answer("so\n#### 1,250\n") == ("1,250", "")
    assert final_answer("#### 6 (for Rissa), but Ronnie has $5.")[1].startswith("(for Rissa)")
    assert final_answer("The answer is 42.")[0] == "42"
    assert final_answer("Answer: B")[0] == ""  # a final answer that is not a number
    assert final_answer("\\boxed{7}")[0] == "7"
    assert final_answer("no idea")[0] is None


def test_arithmetic_errors_are_found_and_rounding_is_forgiven() -> None:
    assert count_arithmetic_errors(GOOD) == 0
    assert count_arithmetic_errors(BAD_MATH) == 2  # the annotation and the inline product
    assert count_arithmetic_errors("10 / 3 = 3.33 and 2.5 x 4 = 10") == 0
    assert count_arithmetic_errors("<<15-(4/5*15)=9>>9") == 1
    assert count_arithmetic_errors("<<__import__('os')=1>>1 and <<2**99999=1>>") == 0  # not run


def test_signals_of_a_partial_answer_are_unknown_where_they_need_the_end() -> None:
    signals = answer_signals(SmallAnswer(NO_FINAL, complete=False), difficulty=0.2)
    assert np.isnan(signals["no_final_answer"])
    assert np.isnan(signals["log_words"])
    assert signals["difficulty"] == 0.2
    assert np.isnan(signals["mean_logprob"])  # none given
    full = answer_signals(SmallAnswer(NO_FINAL, token_logprobs=[-0.1, -2.0]), difficulty=0.2)
    assert full["no_final_answer"] == 1.0
    assert full["mean_logprob"] == pytest.approx(-1.05)
    assert full["min_logprob"] == pytest.approx(-2.0)


def _training_rows(with_logprobs: bool) -> list[LabelledRow]:
    rows = []
    rng = np.random.default_rng(0)
    for i in range(240):
        kind = i % 4
        text = [GOOD, BAD_MATH, NO_FINAL, GOOD][kind]
        confident = kind != 3 or not with_logprobs
        small_ok = kind == 0 or (kind == 3 and not with_logprobs)
        if rng.random() < 0.05:
            small_ok = not small_ok
        logprobs = None
        if with_logprobs:
            level = -0.05 if confident else -1.5
            logprobs = tuple(level + 0.01 * rng.normal(size=5))
        rows.append(LabelledRow(f"q{i}", small_ok, True, text, logprobs))
    return rows


def _verifier(rows: list[LabelledRow]) -> CascadeVerifier:
    features = cascade_features(rows)
    difficulty = np.zeros(len(rows))
    small = np.array([r.small_correct for r in rows], dtype=float)
    large = np.array([r.large_correct for r in rows], dtype=float)
    verifier = fit_cascade(cascade_design(rows, difficulty, features), small, large, features, 1.0)
    return CascadeVerifier.from_json({**verifier.to_json(), "threshold": 0.5})


def test_keep_a_clean_answer_and_escalate_weak_ones() -> None:
    verifier = _verifier(_training_rows(with_logprobs=False))
    assert not set(verifier.features) & LOGPROB_FEATURES  # the data had no logprobs
    keep = verifier.verdict(SmallAnswer(GOOD), difficulty=0.0)
    assert not keep.escalate and keep.reason.startswith("keep")
    wrong = verifier.verdict(SmallAnswer(BAD_MATH), difficulty=0.0)
    assert wrong.escalate and "arithmetic" in wrong.reason
    unfinished = verifier.verdict(SmallAnswer(NO_FINAL), difficulty=0.0)
    assert unfinished.escalate and "final answer" in unfinished.reason
    assert wrong.score > keep.score
    # a lower threshold escalates everything, a higher one nothing
    assert verifier.verdict(SmallAnswer(GOOD), 0.0, threshold=-1.0).escalate
    assert not verifier.verdict(SmallAnswer(BAD_MATH), 0.0, threshold=1.01).escalate


def test_truncated_or_empty_answers_always_escalate() -> None:
    verifier = _verifier(_training_rows(with_logprobs=False))
    cut = verifier.verdict(SmallAnswer(GOOD, finish_reason="length"), 0.0, threshold=0.99)
    assert cut.escalate and "truncated" in cut.reason
    empty = verifier.verdict(SmallAnswer("  "), 0.0, threshold=0.99)
    assert empty.escalate and "empty" in empty.reason


def test_commit_point_verdict_ignores_what_it_cannot_know_yet() -> None:
    verifier = _verifier(_training_rows(with_logprobs=False))
    # the first tokens of a good answer have no final answer yet: that alone must not escalate
    early = verifier.verdict(SmallAnswer(GOOD.split("\n")[0], complete=False), 0.0)
    assert not early.escalate
    early_wrong = verifier.verdict(SmallAnswer(BAD_MATH.split("\n")[0], complete=False), 0.0)
    assert early_wrong.score > early.score


def test_logprobs_enter_the_combiner_when_trained_with_them() -> None:
    rows = _training_rows(with_logprobs=True)
    verifier = _verifier(rows)
    assert set(verifier.features) >= LOGPROB_FEATURES
    sure = verifier.verdict(SmallAnswer(GOOD, token_logprobs=[-0.05] * 5), 0.0)
    unsure = verifier.verdict(SmallAnswer(GOOD, token_logprobs=[-1.5] * 5), 0.0)
    assert not sure.escalate
    assert unsure.escalate and "logprob" in unsure.reason
    # without logprobs at run time the signal is unknown, not "certain"
    unknown = verifier.verdict(SmallAnswer(GOOD), 0.0)
    assert sure.score < unknown.score < unsure.score


def test_shipped_verifier_keeps_clean_answers_and_escalates_broken_ones() -> None:
    verifier = load_verifier()
    assert set(verifier.features) <= set(CASCADE_FEATURES)
    keep = verifier.verdict(SmallAnswer(GOOD), difficulty=0.0)
    broken = verifier.verdict(SmallAnswer(BAD_MATH + " However, I am not sure."), difficulty=0.3)
    assert not keep.escalate
    assert broken.escalate
    assert broken.reason.startswith("escalate:")
