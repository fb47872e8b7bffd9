"""The semantic gate's threshold: the calibrated operating point, raised per namespace only."""

from __future__ import annotations

from cache.gate import SemanticGate, audit_key
from cache.index import Candidate
from cache.verifier import Verifier
from policies.cache import SemanticCacheConfig


def candidate(text: str, similarity: float) -> Candidate:
    return Candidate(entry_id=text, text=text, similarity=similarity)


def test_threshold_follows_the_bound_and_the_audit(verifier: Verifier) -> None:
    gate = SemanticGate(verifier)
    strict, loose = SemanticCacheConfig(max_false_hit_rate=0.0076), SemanticCacheConfig()
    assert gate.threshold(loose, "faq") == verifier.threshold_for(0.01)
    assert gate.threshold(strict, "faq") >= gate.threshold(loose, "faq")
    fixed = SemanticCacheConfig(verifier_threshold=0.3)
    assert gate.threshold(fixed, "faq") == 0.3
    raised = gate.threshold(loose, "faq") + 0.05
    gate.tighten("faq", raised)
    gate.tighten("faq", 0.1)  # never lowered
    assert gate.threshold(loose, "faq") == raised
    assert gate.threshold(loose, "other") == verifier.threshold_for(0.01)
    assert gate.tightened() == {"faq": raised}
    gate.reset("faq")
    assert gate.threshold(loose, "faq") == verifier.threshold_for(0.01)


def test_verdict_carries_the_best_candidate(verifier: Verifier) -> None:
    gate = SemanticGate(verifier)
    settings = SemanticCacheConfig()
    query = "Why is my VPN not connecting?"
    verdict = gate.choose(
        query,
        [candidate("Why isn't my VPN connecting?", 0.98), candidate("Is the VPN down?", 0.6)],
        settings,
        "ns",
    )
    assert verdict.accepted and verdict.winner is not None
    assert verdict.winner.text == "Why isn't my VPN connecting?"
    assert verdict.candidates == 2 and verdict.threshold == gate.threshold(settings, "ns")
    assert verdict.score is not None and verdict.score >= verdict.threshold
    rejected = gate.choose(
        "How do I disable dark mode?",
        [candidate("How do I enable dark mode?", 0.97)],
        settings,
        "ns",
    )
    assert not rejected.accepted and rejected.score == 0.0 and rejected.similarity == 0.97
    below_floor = gate.choose(query, [candidate("unrelated", 0.1)], settings, "ns")
    assert below_floor.candidates == 1 and below_floor.score is None
    # A namespace tightened past every score serves nothing, the others are unaffected.
    gate.tighten("ns", 1.01)
    again = gate.choose(query, [candidate("Why isn't my VPN connecting?", 0.98)], settings, "ns")
    assert not again.accepted
    other = gate.choose(query, [candidate("Why isn't my VPN connecting?", 0.98)], settings, "x")
    assert other.accepted


NEWS = "Police said the man was arrested at his home late on Friday night."
NEWS_PARAPHRASE = "The man was arrested at his home late Friday night, police said."


def test_statement_pairs_have_their_own_operating_point_and_audit_key(
    verifier: Verifier,
) -> None:
    gate = SemanticGate(verifier)
    settings, strict = SemanticCacheConfig(), SemanticCacheConfig(min_precision=0.99)
    shipped = verifier.threshold_for_statements(0.98)
    assert gate.statement_threshold(settings, "ns") == shipped
    assert gate.statement_threshold(strict, "ns") > shipped
    # verifier_threshold fixes the request gate only.
    fixed = SemanticCacheConfig(verifier_threshold=0.3)
    assert gate.statement_threshold(fixed, "ns") == shipped
    verdict = gate.choose(NEWS_PARAPHRASE, [candidate(NEWS, 0.93)], settings, "ns")
    assert verdict.accepted and verdict.kind == "statement" and verdict.threshold == shipped
    # The audit tightens statements apart from requests: the request threshold stays.
    gate.tighten(audit_key("ns", "statement"), 1.01)
    assert gate.statement_threshold(settings, "ns") == 1.01
    assert gate.threshold(settings, "ns") == verifier.threshold_for(0.01)
    assert not gate.choose(NEWS_PARAPHRASE, [candidate(NEWS, 0.93)], settings, "ns").accepted
    request = gate.choose(
        "Why is my VPN not connecting?", [candidate("Why isn't my VPN connecting?", 0.98)],
        settings, "ns",
    )  # fmt: skip
    assert request.accepted and request.kind == "request"
    assert gate.tightened() == {"ns/statements": 1.01}
    gate.reset("ns")
    assert gate.tightened() == {}
    assert gate.choose(NEWS_PARAPHRASE, [candidate(NEWS, 0.93)], settings, "ns").accepted


def test_the_best_accepted_candidate_wins_whatever_its_kind(verifier: Verifier) -> None:
    gate = SemanticGate(verifier)
    settings = SemanticCacheConfig()
    near_miss = "Police said the man was not arrested at his home late on Friday night."
    verdict = gate.choose(
        NEWS_PARAPHRASE, [candidate(near_miss, 0.97), candidate(NEWS, 0.93)], settings, "ns"
    )
    assert verdict.winner is not None and verdict.winner.text == NEWS
    assert verdict.similarity == 0.93
