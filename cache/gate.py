"""The semantic gate: which candidate (if any) a new question may be served, and at what bar.

Candidates come from the vector index above the cosine floor. With ``gate=verifier`` every
candidate is scored by the learned verifier (``cache.verifier``) and the best one wins if its
score reaches the threshold; with ``gate=cosine`` the nearest candidate above the threshold
wins. The verifier's threshold for a namespace is the highest of:

* the operating point for the surface's ``max_false_hit_rate``, read from the calibration
  shipped in the artifact (or ``verifier_threshold`` when the policy fixes one);
* the namespace's tightened threshold, raised by the production audit
  (``cache.audit``) when the false hits it measured exceed the bound. The audit only ever
  raises it, so the gate never accepts more than the shipped calibration allows.

Every decision comes back as a ``GateVerdict`` (candidates seen, the best candidate's cosine and
score, the threshold applied) for the request's span.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from cache.index import Candidate
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

    @property
    def accepted(self) -> bool:
        return self.winner is not None


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

    def threshold(self, settings: SemanticCacheConfig, namespace: str) -> float:
        with self._lock:
            raised = self._tightened.get(namespace, 0.0)
        return max(self.shipped_threshold(settings), raised)

    def tighten(self, namespace: str, threshold: float) -> None:
        """Raise a namespace's threshold (never lowers it)."""
        with self._lock:
            if threshold > self._tightened.get(namespace, 0.0):
                self._tightened[namespace] = threshold

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
        scores = self.verifier.probabilities(
            [c.text for c in above], [query] * len(above), [c.similarity for c in above]
        )
        best = int(np.argmax(scores))
        threshold = self.threshold(settings, namespace)
        score = float(scores[best])
        winner = above[best] if score >= threshold else None
        return GateVerdict(len(candidates), winner, above[best].similarity, score, threshold)
