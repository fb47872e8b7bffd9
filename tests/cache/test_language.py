"""Language and script (cache.language): a question asked in another language is another
request, whatever the multilingual cosine says."""

from __future__ import annotations

import pytest

from cache.embedder import SentenceTransformerEmbedder
from cache.gate import refusal
from cache.language import language, same_language
from cache.verifier import Verifier
from tests.cache.near_misses import judge

# (stored, asked, whether the verifier alone serves it): "Francia" is a name, not a typo of
# "France" (cache.diff), so the verifier misses the second; the check refuses both anyway.
NEAR_MISSES = [
    ("What is the capital of France?", "Quelle est la capitale de la France?", True),
    ("What is the capital of France?", "\u00bfCu\u00e1l es la capital de Francia?", False),
]


@pytest.mark.parametrize(("stored", "asked", "served"), NEAR_MISSES)
def test_the_same_question_in_another_language_is_refused(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, stored: str, asked: str, served: bool
) -> None:
    judged = judge(minilm, verifier, stored, asked)
    assert judged.above_floor and judged.served_by_verifier == served
    assert not judged.verdict.accepted and refusal(stored, asked) == "language"
    assert judged.verdict.refused_by == ("language" if served else None)


def test_scripts_and_languages() -> None:
    assert language("Wie backe ich Brot?") == "de"
    assert language("What is the capital of Italy?") == "en"
    assert language("Qu'est-ce que la photosynth\u00e8se?") == "fr"
    assert not same_language("How do I bake bread?", "Wie backe ich Brot?")
    chinese = "\u6cd5\u56fd\u7684\u9996\u90fd\u662f\u4ec0\u4e48"
    assert refusal("What is the capital of France?", chinese) == "language"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Capital of France?", "France capitale?"),  # too short to tell
        ("What does 'la vie en rose' mean?", "What is the meaning of 'la vie en rose'?"),
        ("How do I say good morning in French?", "How do you say good morning in French?"),
    ],
)
def test_short_quoted_or_same_language_texts_pass(a: str, b: str) -> None:
    assert same_language(a, b)
