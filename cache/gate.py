"""The semantic gate: which candidate (if any) a new question may be served, and at what bar.

Candidates come from the vector index above the cosine floor. With ``gate=verifier`` every
candidate is scored by the learned verifier (``cache.verifier``) as the kind of pair it is (a
request pair or a statement pair, ``cache.statements``) and the best candidate that reaches
its kind's threshold wins; with ``gate=cosine`` the nearest candidate above the threshold
wins. The threshold of a kind, for a namespace, is the highest of:

* the shipped operating point: for request pairs, the one for the surface's
  ``max_false_hit_rate`` (or ``verifier_threshold`` when the policy fixes one); for statement
  pairs, the one for its ``min_precision``; both read from the artifact's calibration;
* the namespace's tightened threshold for that kind, raised by the production audit
  (``cache.audit``) when the false hits it measured exceed the bound. The audit only ever
  raises it, so the gate never accepts more than the shipped calibration allows. Statement
  thresholds are kept under ``<namespace>/statements``.

A candidate the verifier accepts is still refused by a hard check (``CHECKS``) that sees a
difference its features, lower-case English words, cannot: other operators, symbols or signs
(``cache.operators``: "x > 5" against "x < 5", "null == y" against "null === y"), other
capitals in a shared word (``cache.casing``: "CO" against "Co"), another script or language
(``cache.language``), a plural that is a term or a name ("a savings account", "Google
Sheets": ``cache.plurals``), or, around a shared passage, any change of the instruction or question
beside it (``cache.segments``: "<text> Translate into French." against "... German."). The
checks keep the verifier's features as they were trained and calibrated, and can only turn
hits into misses; they run only for candidates the verifier accepted.

Every decision comes back as a ``GateVerdict`` (candidates seen, the best candidate's cosine,
kind and score, the threshold applied, the check that refused it) for the request's span.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cache.calibration import NEVER
from cache.casing import same_case
from cache.index import Candidate
from cache.language import same_language
from cache.operators import same_operators
from cache.plurals import same_terms
from cache.segments import same_instruction
from cache.verifier import Verifier
from policies.cache import COSINE_ONLY_DEFAULT_THRESHOLD, SemanticCacheConfig


@dataclass(frozen=True, slots=True)
class GateVerdict:
    """What the gate saw and decided; ``winner`` is None when nothing was accepted."""

    candidates: int
    winner: Candidate | None = None
    similarity: float | None = None  # the best candidate's cosine (accepted or not)
    score: float | None = None  # the verifier's score of the best candidate
    threshold: float | None = None  # the verifier threshold applied
    kind: Literal["request", "statement"] | None = None  # which gate judged the best candidate
    refused_by: str | None = None  # the check (``CHECKS``) that refused a candidate it passed

    @property
    def accepted(self) -> bool:
        return self.winner is not None


# Hard checks beside the verifier, cheapest first: (name, passes(stored, query)).
CHECKS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("operators", same_operators),
    ("case", same_case),
    ("language", same_language),
    ("plural", same_terms),
    ("shared_text", same_instruction),
)


def refusal(stored: str, query: str) -> str | None:
    """The first check that refuses serving ``stored``'s answer to ``query``; None: none."""
    return next((name for name, passes in CHECKS if not passes(stored, query)), None)


STATEMENTS = "/statements"  # suffix of a namespace's statement threshold and audit


def audit_key(namespace: str, kind: str | None) -> str:
    """Where a namespace's threshold and audit of one kind of pair are kept."""
    return namespace + STATEMENTS if kind == "statement" else namespace


class SemanticGate:
    def __init__(self, verifier: Verifier | None) -> None:
        self.verifier = verifier
        self._tightened: dict[str, float] = {}
        self._lock = threading.Lock()  # read on the search thread, written on the loop

    def floor(self, settings: SemanticCacheConfig) -> float:
        if settings.threshold is not None:
            return settings.threshold
        if settings.gate == "verifier" and self.verifier is not None:
            return self.verifier.cosine_floor
        return COSINE_ONLY_DEFAULT_THRESHOLD

    def shipped_threshold(self, settings: SemanticCacheConfig) -> float:
        if settings.verifier_threshold is not None or self.verifier is None:
            return settings.verifier_threshold if settings.verifier_threshold is not None else 0.0
        return self.verifier.threshold_for(settings.max_false_hit_rate)

    def shipped_statement_threshold(self, settings: SemanticCacheConfig) -> float:
        if self.verifier is None:
            return NEVER
        return self.verifier.threshold_for_statements(settings.min_precision)

    def threshold(self, settings: SemanticCacheConfig, namespace: str) -> float:
        with self._lock:
            raised = self._tightened.get(namespace, 0.0)
        return max(self.shipped_threshold(settings), raised)

    def statement_threshold(self, settings: SemanticCacheConfig, namespace: str) -> float:
        with self._lock:
            raised = self._tightened.get(namespace + STATEMENTS, 0.0)
        return max(self.shipped_statement_threshold(settings), raised)

    def tighten(self, key: str, threshold: float) -> None:
        """Raise a threshold (``audit_key``: a namespace's, or its statements'); never lowers."""
        with self._lock:
            if threshold > self._tightened.get(key, 0.0):
                self._tightened[key] = threshold

    def tightened(self) -> dict[str, float]:
        with self._lock:
            return dict(self._tightened)

    def reset(self, namespace: str | None = None) -> None:
        """Back to the shipped operating point (an operator's decision, via the admin API)."""
        with self._lock:
            if namespace is None:
                self._tightened.clear()
            else:
                self._tightened.pop(namespace, None)
                self._tightened.pop(namespace + STATEMENTS, None)

    def choose(
        self,
        query: str,
        candidates: list[Candidate],
        settings: SemanticCacheConfig,
        namespace: str,
    ) -> GateVerdict:
        floor = self.floor(settings)
        above = [c for c in candidates if c.similarity >= floor]
        if not above:
            return GateVerdict(len(candidates))
        if settings.gate == "cosine" or self.verifier is None:
            if settings.gate == "verifier":
                raise RuntimeError("gate=verifier but no verifier is loaded")
            best_c = max(above, key=lambda c: c.similarity)
            return GateVerdict(len(candidates), best_c, best_c.similarity)
        request_threshold = self.threshold(settings, namespace)
        judged = self.verifier.assess(
            [c.text for c in above],
            [query] * len(above),
            [c.similarity for c in above],
            request_threshold,
        )
        thresholds = np.where(
            judged.statement, self.statement_threshold(settings, namespace), request_threshold
        )
        passed = judged.score >= thresholds
        refused = [
            refusal(c.text, query) if ok else None for c, ok in zip(above, passed, strict=True)
        ]
        accepted = passed & np.array([r is None for r in refused], dtype=bool)
        # The best accepted candidate; when none is, the best score (for the span).
        best = int(np.argmax(np.where(accepted, judged.score + 2.0, judged.score)))
        winner = above[best] if accepted[best] else None
        return GateVerdict(
            len(candidates),
            winner,
            above[best].similarity,
            float(judged.score[best]),
            float(thresholds[best]),
            "statement" if judged.statement[best] else "request",
            refused[best],
        )
