"""The operator and sign check beside the verifier (cache.operators, cache.gate)."""

from __future__ import annotations

import pytest

from cache.embedder import SentenceTransformerEmbedder
from cache.gate import SemanticGate
from cache.index import Candidate
from cache.operators import same_operators, signature
from cache.verifier import Verifier
from policies.cache import SemanticCacheConfig
from tests.cache.near_misses import judge

# Near misses the verifier cannot see: the words are the same, a symbol or sign is not.
DIFFERENT = [
    ("Is x > 5 when x = 7?", "Is x < 5 when x = 7?"),
    ("Is 10 > 3 true?", "Is 10 < 3 true?"),
    ("Does a >= b hold if a = 2 and b = 3?", "Does a <= b hold if a = 2 and b = 3?"),
    (
        "In Python, what does x != y return when both are 1?",
        "In Python, what does x == y return when both are 1?",
    ),
    ("What is -5 squared?", "What is 5 squared?"),
    ("Evaluate 2^10", "Evaluate 2*10"),
    ("What is the temperature -40 in Fahrenheit?", "What is the temperature 40 in Fahrenheit?"),
    ("What is 1/2 + 1/3?", "What is 1/2 - 1/3?"),
    ("Compute 7 - 3", "Compute 7 + 3"),
    ("Fix this code: return x+1", "Fix this code: return x-1 * 2"),
    # Same operators, on other operands: which comparison goes with which number.
    ("Is x > 5 and y < 3?", "Is x < 5 and y > 3?"),
    ("Solve x = -5", "Solve x = 5"),
    ("Is the interval (-3, 4) open?", "Is the interval (3, 4) open?"),
    # Operators between longer words, redirections, slices, Unicode symbols, currencies.
    ("What does null == undefined return?", "What does null === undefined return?"),
    ("What does null == undefined return?", "What does null != undefined return?"),
    ("What does isReady && isValid give?", "What does isReady || isValid give?"),
    ("What does ls > out.txt do?", "What does ls >> out.txt do?"),
    ("What does cat log | grep error do?", "What does cat log > grep error do?"),
    ("What does total += bonus do?", "What does total -= bonus do?"),
    ("What does count++ do in C?", "What does count-- do in C?"),
    ("What does items[1:] return?", "What does items[:1] return?"),
    ("What does the regex ab* match?", "What does the regex ab+ match?"),
    ("Is 10 \u2a7e 5?", "Is 10 \u2a7d 5?"),
    ("Is x \u226b y?", "Is x \u226a y?"),
    ("Is x \u2192 y true?", "Is x \u2190 y true?"),
    ("Is A \u2227 B true?", "Is A \u2228 B true?"),
    ("How much is 100 $ in yen?", "How much is 100 \u20ac in yen?"),
    ("What is 5% of 80?", "What is 5 of 80?"),
]

# Pairs whose symbols are punctuation, hyphens of words, ranges, dates, units, or another
# spelling of the same operator: the check must not stand between them.
SAME = [
    ("What is a state-of-the-art e-mail filter?", "What is a state of the art email filter?"),
    ("How dangerous is an x-ray?", "How dangerous is an xray?"),
    ("Symptoms of COVID-19?", "Symptoms of COVID 19?"),
    ("Book a table for 5-10 people", "Book a table for 5-10 people, please!"),
    ("What happened on 2024-01-02?", "What happened on 2024-01-02 ?"),
    ("Where do I get my W-2 form?", "where do i get my W-2"),
    ("How do I fix my A/C?", "My A/C is broken - how do I fix it?"),
    ("Speed of light in km/h", "What's the speed of light in km/h?"),
    ("Explain TCP/IP and/or UDP", "Explain TCP/IP and/or UDP."),
    ("What does the <div> tag do?", "What is the <div> tag for?"),
    ("Bonds lost 2/32 -- a full point -- by 10:30", "By 10:30, bonds had lost 2/32."),
    ("Is x > 5 when x = 7?", "If x = 7, is x > 5?"),  # reordered
    ("Compute 2**10", "Compute 2^10"),
    ("Is x \u2264 5?", "Is x <= 5?"),
    ("What's 2+2?", "What is 2 + 2?"),
    ("How do I use ls -l?", "How to use ls -l"),
    ("Is x \u2192 y true?", "Is x -> y true?"),
    ("Is 10 \u2a7e 5?", "Is 10 >= 5?"),
    ("What is 5 \uff0b 3?", "What is 5 + 3?"),
    ("Steps:\n* boil water\n* add pasta", "Steps:\n- boil water\n- add pasta"),
    ("The stock rose 5 percent to $30.", "The stock rose 5% to $30.50."),
    ("Question: what is R&D?", "Question:  what is R&D?"),
]


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_operators_or_signs_differ(a: str, b: str) -> None:
    assert signature(a) != signature(b)
    assert not same_operators(a, b) and not same_operators(b, a)


@pytest.mark.parametrize(("a", "b"), SAME)
def test_hyphens_ranges_dates_and_punctuation_are_not_operators(a: str, b: str) -> None:
    assert same_operators(a, b), (signature(a), signature(b))


def test_the_signature_names_operands_and_negative_numbers() -> None:
    assert signature("Is x > 5 when x = -7?") == {
        ("x", ">", "5"): 1,
        ("x", "=", "-7"): 1,
        ("", "-", "7"): 1,
    }
    assert signature("A plain question, with no symbols at all?") == {}


def test_the_gate_refuses_what_the_verifier_accepts_when_the_operators_differ(
    verifier: Verifier,
) -> None:
    gate = SemanticGate(verifier)
    settings = SemanticCacheConfig()
    stored, asked = "Is x > 5 when x = 7?", "Is x < 5 when x = 7?"
    judged = verifier.assess([stored], [asked], [0.9432])
    assert judged.score[0] >= gate.threshold(settings, "ns")  # the verifier alone would serve it
    verdict = gate.choose(asked, [Candidate(stored, stored, 0.9432)], settings, "ns")
    assert not verdict.accepted
    assert verdict.candidates == 1 and verdict.score == float(judged.score[0])
    # Another candidate, with the same operators, still wins.
    twin = "is x < 5 when x = 7"
    both = [Candidate(stored, stored, 0.9432), Candidate(twin, twin, 0.93)]
    chosen = gate.choose(asked, both, settings, "ns")
    assert chosen.winner is not None and chosen.winner.text == twin


# Near misses that the embedder (0.78-1.0) and the verifier alone both served.
SERVED_WITHOUT_THE_CHECK = [
    (
        "In JavaScript, what does null == undefined return?",
        "In JavaScript, what does null === undefined return?",
    ),
    (
        "In JavaScript, what does null == undefined return?",
        "In JavaScript, what does null != undefined return?",
    ),
    (
        "What does the shell command ls > out.txt do?",
        "What does the shell command ls >> out.txt do?",
    ),
    (
        "What does the Python expression items[1:] return?",
        "What does the Python expression items[:1] return?",
    ),
    ("Is 10 \u2a7e 5?", "Is 10 \u2a7d 5?"),
    ("Is x \u226b y?", "Is x \u226a y?"),
    ("Is x \u2192 y true?", "Is x \u2190 y true?"),
]


@pytest.mark.parametrize(("stored", "asked"), SERVED_WITHOUT_THE_CHECK)
def test_the_gate_refuses_operators_between_words_slices_and_unicode_symbols(
    minilm: SentenceTransformerEmbedder, verifier: Verifier, stored: str, asked: str
) -> None:
    judged = judge(minilm, verifier, stored, asked)
    assert judged.above_floor and judged.served_by_verifier
    assert not judged.verdict.accepted and judged.verdict.refused_by == "operators"
