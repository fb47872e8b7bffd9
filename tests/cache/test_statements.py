"""Statement pairs: told apart by the form of the text, judged by their own gate."""

from __future__ import annotations

import random

import pytest

from cache.lexicon import Lexicon
from cache.statements import STATEMENT_FEATURE_NAMES, _lcs, is_statement, statement_features
from cache.verifier import DEFAULT_MIN_PRECISION, Verifier

PROFIT = "The company said on Monday that its quarterly profit rose 12 percent to $1.3 billion."
ARREST = "Police said the man was arrested at his home late on Friday night."


@pytest.fixture(scope="module")
def lex() -> Lexicon:
    return Lexicon.shared()


@pytest.mark.parametrize(
    ("text", "statement"),
    [
        (PROFIT, True),
        (ARREST, True),  # "police" is a verb too, but a noun first: not an imperative
        ("I have been charged twice for the same order this month.", True),
        ("How do I reset my password on the new portal?", False),  # a question
        ("Can't find the settings menu in the new Outlook app at all.", False),  # auxiliary
        ("Write a function that reverses a linked list in Python.", False),  # imperative
        ("Format the selected cells as currency in Excel, please.", False),  # verb + object
        ("pandas: drop all rows with NaN values from a DataFrame.", False),  # tool prefix
        ("Tell me what the capital of France is, if you know it.", False),
        ("the company said on monday that its profit rose 12 percent.", False),  # lower case
        ("Shares of the company fell 5 percent in early trading on Tuesday", False),  # no end
        ("The profit rose 12 percent.", False),  # too short
        ('He said "you can keep the change" and walked out of the shop.', True),  # quoted
    ],
)
def test_is_statement(text: str, statement: bool, lex: Lexicon) -> None:
    assert is_statement(text, lex) is statement


def test_statement_features_read_what_one_side_adds(lex: Lexicon) -> None:
    added = "On Monday the company said its quarterly profit had risen 12 percent, and it raised its forecast."
    f = dict(zip(STATEMENT_FEATURE_NAMES, statement_features(PROFIT, added, lex), strict=True))
    # Only the second side has "raised" (an inflected verb: a new predicate) and "forecast";
    # "risen" and "rose" share the base form "rise"; "$1.3 billion" is on the first side only.
    assert (f["only_words_max"], f["only_verbs_max"], f["only_verbs_min"]) == (2, 1, 0)
    assert (f["only_words_min"], f["only_numbers_max"]) == (2, 1)  # "1.3", "billion"
    same = dict(zip(STATEMENT_FEATURE_NAMES, statement_features(PROFIT, PROFIT, lex), strict=True))
    assert same["bigram_min"] == same["lcs_shorter"] == 1.0 and same["only_words_max"] == 0
    assert 0 < f["bigram_min"] < f["bigram_max"] < 1 and f["lcs_longer"] < f["lcs_shorter"]


def test_statement_pairs_are_judged_by_the_statement_gate(verifier: Verifier) -> None:
    threshold = verifier.threshold_for_statements(DEFAULT_MIN_PRECISION)
    assert 0.5 < threshold < 1.0
    pairs = [
        (PROFIT, "On Monday the company said its quarterly profit had risen 12 percent to $1.3 billion."),
        (ARREST, "The man was arrested at his home late Friday night, police said."),
        # A near miss written as a statement: another number, an antonym, a negation.
        (PROFIT, "The company said on Monday that its quarterly profit rose 15 percent to $1.3 billion."),
        (PROFIT, "The company said on Monday that its quarterly profit fell 12 percent to $1.3 billion."),
        (ARREST, "Police said the man was not arrested at his home late on Friday night."),
    ]  # fmt: skip
    judged = verifier.assess([a for a, _ in pairs], [b for _, b in pairs], [0.95] * len(pairs))
    assert judged.statement.all()
    assert judged.score[0] >= threshold and judged.score[1] >= threshold
    assert list(judged.score[2:]) == [0.0, 0.0, 0.0]


def test_requests_stay_with_the_request_gate(verifier: Verifier) -> None:
    a, b = "Why isn't my VPN connecting?", "Why is my VPN not connecting?"
    judged = verifier.assess([a], [b], [0.98])
    assert not judged.statement[0]
    assert judged.score[0] == pytest.approx(verifier.score(a, b, 0.98))


def _lcs_table(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def test_bit_parallel_lcs_matches_the_table() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 40))]
        b = [rng.choice("abcdef") for _ in range(rng.randint(0, 40))]
        assert _lcs(a, b) == _lcs_table(a, b), (a, b)
    assert _lcs(["the", "man", "was", "arrested"], ["police", "arrested", "the", "man"]) == 2
