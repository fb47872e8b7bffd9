"""Letter case (cache.casing): the embedder and the verifier are lower case; acronyms, units,
chemical symbols, names and identifiers are not."""

from __future__ import annotations

import pytest

from cache.casing import same_case
from cache.embedder import SentenceTransformerEmbedder
from cache.gate import refusal
from cache.verifier import Verifier
from tests.cache.near_misses import judge

NEAR_MISSES = [
    ("What is the molar mass of CO?", "What is the molar mass of Co?"),
    ("How many bytes are in 1 MB?", "How many bytes are in 1 Mb?"),
    ("How many mg in 1 g?", "How many Mg in 1 g?"),
    ("What's the difference between mW and MW?", "What's the difference between mW and mw?"),
    ("What is the symbol Pb?", "What is the symbol PB?"),
    ("What is US policy on Cuba?", "What is us policy on Cuba?"),
    ("What does getUserName return?", "What does getUsername return?"),
    ("Tell me about the IT department", "Tell me about the it department"),
    ("What is the population of Turkey?", "What is the population of turkey?"),
    ("What is Set in Java?", "What is set in Java?"),
    ("Is NO a toxic gas?", "Is No a toxic gas?"),
]


@pytest.mark.parametrize(("stored", "asked"), NEAR_MISSES)
def test_a_word_capitalised_otherwise_is_another_question(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, stored: str, asked: str
) -> None:
    judged = judge(minilm, verifier, stored, asked)
    assert judged.cosine > 0.99 and judged.served_by_verifier  # uncased: one text to both
    assert not judged.verdict.accepted and judged.verdict.refused_by == "case"
    assert refusal(asked, stored) == "case"


PARAPHRASES = [
    ("WHAT IS THE CAPITAL OF FRANCE?", "What is the capital of France?"),
    ("what is the capital of france?", "What is the capital of France?"),
    ("Where is the Eiffel Tower?", "where is the Eiffel Tower?"),
    ("Hello. Where is Paris?", "hello. where is Paris?"),
    ("CO levels are high. Why?", "CO levels are high. why?"),
    ("Explain the difference between Set and set", "Explain the difference between set and Set"),
    ("Do I need a visa for Japan?", "Do i need a visa for Japan?"),
    ("The State Department said so on Monday.", "The state department said so on Monday."),
    ('He said, "We will win."', 'He said: "we will win."'),
]


@pytest.mark.parametrize(("a", "b"), PARAPHRASES)
def test_sentence_starts_whole_text_case_and_names_are_not_differences(a: str, b: str) -> None:
    assert same_case(a, b) and same_case(b, a)
