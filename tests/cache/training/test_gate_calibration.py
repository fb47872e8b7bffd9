"""The figures of the two gates from stored scores: which score decides which pair."""

from __future__ import annotations

import numpy as np

from cache.training.gate_calibration import Pairs, calibrate, hits


def pairs() -> Pairs:
    # Dev: 60 statement pairs (40 paraphrases), 4 request pairs; near-miss: 4 pairs.
    origin = ["dev"] * 64 + ["nearmiss"] * 4
    source = ["mrpc"] * 60 + ["sts_qq"] * 4 + ["negation", "negation", "typo", "typo"]
    label = [1] * 40 + [0] * 20 + [1, 0, 1, 0] + [0, 0, 1, 1]
    statement = [True] * 60 + [False] * 4 + [True, False, True, False]
    return Pairs(
        np.array(origin), np.array(source), np.array(label), np.array(statement, dtype=bool)
    )


def test_statement_pairs_are_decided_by_their_own_score() -> None:
    p = pairs()
    request = np.full(68, 0.0)
    statement = np.full(68, np.nan)
    statement[:40] = 0.99  # the 40 dev paraphrases: high statement scores
    statement[40:60] = 0.5
    request[:60] = 0.99  # a request score on a statement pair decides nothing
    request[60:64] = [0.95, 0.1, 0.2, 0.99]  # request pairs: one right hit, one false hit
    statement[64], statement[66] = 0.99, 0.2  # near-miss statement pairs
    request[[64, 65, 66, 67]] = [0.0, 0.95, 0.99, 0.95]
    scored, hit = hits(p, request, statement, 0.9, 0.98)
    assert scored.all()
    assert hit[:40].all() and not hit[40:60].any()
    assert list(hit[60:]) == [True, False, False, True, True, True, False, True]


def test_calibrate_reports_both_gates() -> None:
    p = pairs()
    request = {s: np.full(68, 0.0) for s in ("topic", "plain", "kind")}
    statement = {s: np.full(68, np.nan) for s in request}
    for s in request:
        statement[s][:40] = 0.99
        statement[s][40:60] = np.linspace(0.5, 0.9, 20)
        statement[s][[64, 66]] = [0.2, 0.99]  # a near miss and a paraphrase, as statements
        request[s][66:] = 0.97
    calibrated = calibrate(p, request, statement)
    topic = calibrated.report["topic"]
    assert topic["statement_threshold"] <= 0.99 and topic["statement_threshold"] > 0.9
    assert topic["dev"]["by_gate"]["statement"]["precision"]["hits"] == 40
    assert topic["dev"]["precision"]["rate"] == 1.0
    near = topic["nearmiss"]
    assert (near["statement_pairs"]["n"], near["statement_pairs"]["hits"]) == (2, 1)
    # Two near misses back no request threshold (their Wilson bound is far above 1%): only
    # the statement paraphrase is served.
    assert topic["threshold"] > 1.0
    assert near["false_hit_rate"]["hits"] == 0 and near["paraphrase_recall"]["hits"] == 1
    # Dev pairs are scored in the topic split only.
    assert "dev" not in calibrated.report["plain"]
