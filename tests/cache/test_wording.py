"""Near misses worded like the question they miss, judged by the shipped gate with the real
embedder's cosine, both ways round: each was served before its fix (the probe of realistic
traffic, /tmp/probe-wording), and must not be."""

from __future__ import annotations

import pytest

from cache.diff import align
from cache.embedder import SentenceTransformerEmbedder
from cache.lexicon import Lexicon
from cache.verifier import Verifier
from tests.cache.near_misses import assert_never_served

# Names a letter or two apart: two functions, two drugs, two products, two accounts. Neither
# is a misspelling of a dictionary word, or the unknown one is written like a name.
NEAR_NAMES = [
    (
        "What does np.argmax return for a 2D array?",
        "What does np.argmin return for a 2D array?",
    ),
    (
        "How does strftime handle time zones in Python?",
        "How does strptime handle time zones in Python?",
    ),
    ("When should I use getattr in Python?", "When should I use setattr in Python?"),
    ("What does malloc return when it fails?", "What does calloc return when it fails?"),
    ("Why is strcpy considered unsafe in C?", "Why is strncpy considered unsafe in C?"),
    (
        "What is the usual starting dose of Novolog?",
        "What is the usual starting dose of Novolin?",
    ),
    (
        "What is the side effect profile of Lexapro?",
        "What is the side effect profile of Lexipro?",
    ),
    ("How do I set up CI/CD with GitHub Actions?", "How do I set up CI/CD with GitLab Actions?"),
    ("Is Pydantic faster than dataclasses?", "Is pedantic faster than dataclasses?"),
    ("How do I deploy a FastAPI app on Heroku?", "How do I deploy a fastai app on Heroku?"),
    ("How do I install Xubuntu on an old laptop?", "How do I install Lubuntu on an old laptop?"),
    (
        "Why can't user jsmith log in to the dashboard?",
        "Why can't user jsmyth log in to the dashboard?",
    ),
    ("Why does the deploy to cluster euwest fail?", "Why does the deploy to cluster uswest fail?"),
    (
        "We are a team of five developers. We use GitHub for code and Jira for tickets. We want "
        "to release every two weeks. How should we set up our branches?",
        "We are a team of five developers. We use GitLab for code and Jira for tickets. We want "
        "to release every two weeks. How should we set up our branches?",
    ),
]


# A name as the text's first word, a letter or two from a dictionary word: its capital says
# nothing there, but a name it may be (before: read as a typo of the word, and served).
FIRST_WORD_NAMES = [
    ("Pydantic or dataclasses: which is faster?", "Pedantic or dataclasses: which is faster?"),
    ("Deno deploy: how much does it cost?", "Demo deploy: how much does it cost?"),
    (
        "Gradle builds are slow, how do I speed them up?",
        "Grade builds are slow, how do I speed them up?",
    ),
    ("Kotlin or Java for a new Android app?", "Kaolin or Java for a new Android app?"),
]


@pytest.mark.parametrize(("a", "b"), NEAR_NAMES + FIRST_WORD_NAMES)
def test_names_a_letter_apart_are_not_typos(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, a: str, b: str
) -> None:
    assert align(a, b, Lexicon.shared()).typos == 0
    assert_never_served(minilm, verifier, a, b)


def test_a_misspelt_dictionary_word_is_still_a_typo() -> None:
    lex = Lexicon.shared()
    assert align("How do I receive a refund?", "How do I recieve a refund?", lex).typos == 1
    assert align("Why is my laptop so slow?", "Why is my labtop so slow?", lex).typos == 1


# Statements (a request written as a sentence) that swap two things around a word, or change
# a number among reworded words: the request gate vetoes these, so must the statement gate.
STATEMENT_SWAPS_AND_NUMBERS = [
    (
        "I want to invest in index funds rather than individual stocks.",
        "I want to invest in individual stocks rather than index funds.",
    ),
    (
        "I ordered a blue sweater in size medium but received a red one.",
        "I ordered a red sweater in size medium but received a blue one.",
    ),
    (
        "A customer paid with PayPal and wants a refund to a credit card.",
        "A customer paid with a credit card and wants a refund to PayPal.",
    ),
    (
        "The recipe calls for 200 grams of flour and two eggs for the batter.",
        "For the batter the recipe needs 250 grams of flour and two eggs.",
    ),
    (
        "Our server has 16 GB of memory and runs out during nightly builds.",
        "The build server, with 32 GB of memory, runs out of it during the nightly builds.",
    ),
]


@pytest.mark.parametrize(("a", "b"), STATEMENT_SWAPS_AND_NUMBERS)
def test_statements_keep_the_request_vetoes(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, a: str, b: str
) -> None:
    assert verifier.assess([a], [b], [0.95]).statement[0]
    assert_never_served(minilm, verifier, a, b)


# Statements that differ in one word the request gate would not accept as a synonym: another
# ordinal, period, tier or format.
STATEMENT_ONE_WORD = [
    (
        "I need a lesson plan on fractions for fifth grade students.",
        "I need a lesson plan on fractions for seventh grade students.",
    ),
    (
        "The package should be left at the second door on the left.",
        "The package should be left at the third door on the left.",
    ),
    (
        "The contract ends on the twelfth of March next year.",
        "The contract ends on the twentieth of March next year.",
    ),
    (
        "The shipment left the warehouse in Chicago on the morning of the fourth.",
        "The shipment left the warehouse in Chicago on the morning of the fourteenth.",
    ),
    (
        "I was charged twice for the annual subscription and need a refund.",
        "I was charged twice for the monthly subscription and need a refund.",
    ),
    (
        "The customer wants a quarterly report instead of a weekly summary.",
        "The customer wants a quarterly report instead of a monthly summary.",
    ),
    (
        "The customer on the Gold tier asks about lounge access.",
        "The customer on the Silver tier asks about lounge access.",
    ),
    (
        "The output should be formatted as a Markdown table with two columns.",
        "The output should be formatted as an HTML table with two columns.",
    ),
]


@pytest.mark.parametrize(("a", "b"), STATEMENT_ONE_WORD)
def test_a_one_word_change_in_a_statement_is_judged_as_in_a_question(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, a: str, b: str
) -> None:
    assert verifier.assess([a], [b], [0.95]).statement[0]
    assert_never_served(minilm, verifier, a, b)


def test_ordinals_are_numbers() -> None:
    lex = Lexicon.shared()
    changed = align("for fifth grade students", "for seventh grade students", lex)
    assert [(x.norm, y.norm) for x, y in changed.substituted] == [("5", "7")]
    same = align("Leave it at the third door.", "Leave it at the 3rd door.", lex)
    assert not (same.substituted or same.deleted or same.inserted)
    # "seconds" is a unit, not the ordinal.
    assert align("Wait 30 seconds.", "Wait 30 seconds.", lex).a[-1].norm == "seconds"
