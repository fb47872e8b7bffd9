"""Requests around a shared passage (cache.segments, and cache.statements' reading of a
passage followed by a request): the instruction or question beside the passage is judged
alone, strictly, whatever the length of the passage."""

from __future__ import annotations

import pytest

from cache.embedder import SentenceTransformerEmbedder
from cache.gate import refusal
from cache.lexicon import Lexicon
from cache.segments import same_instruction, segments
from cache.statements import is_statement
from cache.verifier import Verifier
from tests.cache.near_misses import judge

MEETING = (
    "The committee met on Tuesday to review the annual budget. Members discussed the "
    "allocation for road repairs, the new library wing, and the expansion of the public "
    "transport network."
)
LIBRARY = (
    "The new library opened in March after two years of construction. Visitors praised the "
    "reading rooms and the children's corner. Parking near the building remains scarce."
)

# Different requests about one passage: the embedder (0.85-0.99) and the verifier or the
# statement gate served each of these before the shared-text check.
NEAR_MISSES = [
    (
        f"{MEETING} Translate the text above into French.",
        f"{MEETING} Translate the text above into German.",
    ),
    (
        f"{MEETING} Question: who chaired the meeting?",
        f"{MEETING} Question: who was absent from the meeting?",
    ),
    (
        f"{MEETING} Translate the text above into French.",
        f"{MEETING} Question: who chaired the meeting?",
    ),
    (f"Summarize: {MEETING}", f"Translate to Japanese: {MEETING}"),
    (
        f"{MEETING} Count the words in the text above.",
        f"{MEETING} Count the sentences in the text above.",
    ),
    (f"{MEETING} List every number in the text.", f"{MEETING} List every name in the text."),
    (MEETING, f"{MEETING} Write a poem about the text above."),
    (
        f"{LIBRARY} Summarize the text above in one sentence.",
        f"{LIBRARY} Summarize the text above in one paragraph.",
    ),
    (
        f"{LIBRARY}\nList the complaints in this review.",
        f"{LIBRARY}\nList the compliments in this review.",
    ),
    (f"Summarize: {LIBRARY} It closes at nine.", f"Summarize: {LIBRARY} It closes at noon."),
]


@pytest.mark.parametrize(("stored", "asked"), NEAR_MISSES)
def test_another_request_about_the_same_passage_is_refused(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, stored: str, asked: str
) -> None:
    judged = judge(minilm, verifier, stored, asked)
    assert judged.above_floor
    assert not judged.verdict.accepted
    assert refusal(stored, asked) == "shared_text" and refusal(asked, stored) == "shared_text"


def test_the_verifier_alone_would_serve_some_of_them(
    minilm: SentenceTransformerEmbedder, verifier: Verifier
) -> None:
    """Why the check exists: the request gate's features are diluted by the passage."""
    served = [p for p in NEAR_MISSES if judge(minilm, verifier, *p).served_by_verifier]
    assert len(served) >= 3
    for stored, asked in served:
        verdict = judge(minilm, verifier, stored, asked).verdict
        assert verdict.refused_by == "shared_text" and verdict.kind == "request"


def test_a_passage_followed_by_a_request_is_not_a_statement() -> None:
    lex = Lexicon.shared()
    assert is_statement(MEETING, lex)
    for request in (
        "Translate the text above into French.",
        "Count the words in the text above.",
        "Question: who chaired the meeting?",
        "List every number in the text.",
    ):
        assert not is_statement(f"{MEETING} {request}", lex), request
    # A period after an initial or an abbreviation ends no sentence: still one statement.
    text = "Shares of Walgreen Co. rose 5 cents after U.S. sales grew. Traders cheered it."
    assert is_statement(text, lex)


# The same request around the same passage, written otherwise: left to the verifier.
PARAPHRASES = [
    (
        f"{MEETING} Translate the text above into French.",
        f"{MEETING} Please translate the text above into French.",
    ),
    (
        f"{MEETING} Translate the text above into French.",
        f"{MEETING}\n\nTranslate the text above into French!",
    ),
    (
        f"{MEETING} Translate the text above into French.",
        f"{MEETING} Tranlsate the text above into French.",
    ),
    (f"{MEETING} Summarize the text.", f"Summarize the text. {MEETING}"),
    (f"{MEETING} Who chaired the meeting?", f"{MEETING} who chaired the meeting?"),
    (f"{MEETING} Give a big summary.", f"{MEETING} Give a large summary."),
    ("What is 2 + 2?", "What's 2 plus 2?"),  # no shared segment: the verifier's alone
]


@pytest.mark.parametrize(("a", "b"), PARAPHRASES)
def test_the_same_request_written_otherwise_is_left_to_the_verifier(a: str, b: str) -> None:
    assert same_instruction(a, b) and same_instruction(b, a)


def test_segments_are_sentences_labels_and_lines() -> None:
    text = "Retailers J.C. Penney Co. Inc. report on Monday. Question: who?\nNext line"
    assert [words for _, words in segments(text)] == [
        "retailers j c penney co inc report on monday",
        "question",
        "who",
        "next line",
    ]
    assert not same_instruction(f"{LIBRARY} Is it open?", f"{LIBRARY} Is it not open?")
    assert not same_instruction(f"{LIBRARY} Who built it?", f"{LIBRARY} Who killed it?")
