"""How the shipped gate, with the real embedder's cosine, judges one (stored, asked) pair:
the near-miss tests of the gate's hard checks (``cache.gate.CHECKS``) read it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache.embedder import SentenceTransformerEmbedder
from cache.gate import GateVerdict, SemanticGate
from cache.index import Candidate
from cache.verifier import Verifier
from policies.cache import SemanticCacheConfig


@dataclass(frozen=True)
class Judged:
    cosine: float
    above_floor: bool  # the index hands the stored text to the gate
    served_by_verifier: bool  # the verifier alone (its score against its kind's threshold)
    verdict: GateVerdict  # the gate: the verifier and the hard checks


def judge(
    model: SentenceTransformerEmbedder, verifier: Verifier, stored: str, asked: str
) -> Judged:
    gate, settings = SemanticGate(verifier), SemanticCacheConfig()
    va, vb = model.embed_sync([stored, asked])
    cosine = float(np.dot(va, vb))
    assessed = verifier.assess([stored], [asked], [cosine], gate.threshold(settings, "ns"))
    bar = (gate.statement_threshold if assessed.statement[0] else gate.threshold)(settings, "ns")
    verdict = gate.choose(asked, [Candidate(stored, stored, cosine)], settings, "ns")
    return Judged(cosine, cosine >= gate.floor(settings), bool(assessed.score[0] >= bar), verdict)


def assert_never_served(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, a: str, b: str
) -> None:
    for stored, asked in ((a, b), (b, a)):
        verdict = judge(minilm, verifier, stored, asked).verdict
        assert not verdict.accepted, (stored, asked, verdict)
