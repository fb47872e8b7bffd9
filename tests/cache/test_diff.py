"""The gate's reading of the difference between two requests, on crafted pairs."""

from __future__ import annotations

import random
import time

import pytest

import cache.diff
from cache.diff import MAX_ALIGN_WORK, MAX_INVERSIONS, MAX_TYPO_TRIALS, align
from cache.gate import CHECKS
from cache.lexicon import Lexicon
from cache.pairfeatures import FEATURE_NAMES, pair_features, relation
from cache.semantic import MAX_SEMANTIC_CHARS
from cache.verifier import Verifier
from cache.words import Token, edit_distance, prefix_contrast


@pytest.fixture(scope="module")
def lex() -> Lexicon:
    return Lexicon.shared()


def features(a: str, b: str, lex: Lexicon) -> dict[str, float]:
    return dict(zip(FEATURE_NAMES, pair_features(a, b, 0.9, lex), strict=True))


def test_negation_flip_and_contractions(lex: Lexicon) -> None:
    f = features("Is a signed offer letter binding?", "Is a signed offer letter not binding?", lex)
    assert f["negation_flip"] == 1.0
    g = features("Why isn't my VPN connecting?", "Why is my VPN not connecting?", lex)
    assert g["negation_flip"] == 0.0 and g["changed_content"] == 0.0
    h = features("He's got a fever. Should I call?", "He has got a fever. Should I call?", lex)
    assert h["changed_total"] == 0.0


def test_antonyms_from_wordnet_and_prefixes(lex: Lexicon) -> None:
    assert (
        features("How do I enable dark mode?", "How do I disable dark mode?", lex)["sub_antonym"]
        == 1.0
    )
    assert (
        features("Is it legal to record calls?", "Is it illegal to record calls?", lex)[
            "sub_antonym"
        ]
        == 1.0
    )
    assert prefix_contrast("encrypt", "decrypt") and prefix_contrast("upload", "download")
    assert not prefix_contrast("methanol", "ethanol")


def test_synonyms_siblings_and_values(lex: Lexicon) -> None:
    f = features("How do I buy a gift card?", "How do I purchase a gift card?", lex)
    assert f["sub_synonym"] == 1.0 and f["sub_antonym"] == 0.0
    g = features("What's 5 miles in kilometers?", "What's 5 miles in meters?", lex)
    assert g["sub_value"] == 1.0 and g["changed_unit"] >= 1.0 and g["sub_synonym"] == 0.0
    # WordNet shares a loose sense ("a moment") between the two; as units they differ.
    h = features("set a timer for 90 seconds", "set a timer for 90 minutes", lex)
    assert h["sub_value"] == 1.0 and h["sub_synonym"] == 0.0
    diff = align("What is the VAT rate in Italy?", "What is the VAT rate in Germany?", lex)
    ((x, y),) = diff.substituted
    assert relation(x, y, lex) in ("value", "sibling")


def test_numbers_compare_as_values(lex: Lexicon) -> None:
    f = features("What is 2 to the power of 10?", "What is 3 to the power of 10?", lex)
    assert f["number_changed"] == 1.0 and f["number_substituted"] == 1.0
    g = features("How many days after one year?", "How many days after 1 year?", lex)
    assert g["number_changed"] == 0.0
    h = features("It costs 2,000 dollars", "It costs 2000 dollars", lex)
    assert h["number_changed"] == 0.0


def test_swaps_around_a_pivot_versus_symmetric_and_fronted(lex: Lexicon) -> None:
    direction = features("Convert YAML to JSON in Python", "Convert JSON to YAML in Python", lex)
    assert direction["pivot_swaps"] >= 1.0 and direction["changed_content"] == 0.0
    roles = features("Did the Romans conquer the Gauls?", "Did the Gauls conquer the Romans?", lex)
    assert roles["pivot_swaps"] >= 1.0
    symmetric = features(
        "Which has more calories, brown rice or white rice?",
        "Which has more calories, white rice or brown rice?",
        lex,
    )
    assert symmetric["pivot_swaps"] == 0.0
    fronted = features(
        "In Excel, how do I freeze the top row?", "How do I freeze the top row in Excel?", lex
    )
    assert fronted["runs"] == 2.0 and fronted["pivot_swaps"] == 0.0
    assert fronted["changed_total"] == 0.0


def test_typos_compounds_and_acronyms(lex: Lexicon) -> None:
    f = features(
        "How do I change my email address on my account?",
        "how do i chnage my emial adress on my account",
        lex,
    )
    assert f["typos"] >= 2.0 and f["changed_content"] == 0.0
    # Two different short acronyms are never one typo of the other.
    g = features("Output the results as CSV.", "Output the results as TSV.", lex)
    assert g["typos"] == 0.0 and g["changed_content"] == 2.0
    h = features("How do I redirect HTTPS to HTTP?", "How do I redirect HTTP to HTTPS?", lex)
    assert h["pivot_swaps"] >= 1.0
    assert features("How do I set up Python?", "How do I setup Python?", lex)["compounds"] == 1.0


def test_classes_of_changed_words(lex: Lexicon) -> None:
    f = features("Normal heart rate for an adult?", "Normal heart rate for a toddler?", lex)
    assert f["changed_person"] >= 1.0
    g = features("What's the weather tomorrow?", "What's the weather on Friday?", lex)
    assert g["changed_time"] >= 1.0
    h = features("Summarize the whole document", "Summarize the first paragraph", lex)
    assert h["quantifier_changed"] >= 1.0


def test_edit_distance() -> None:
    assert edit_distance("chnage", "change") == 1  # one transposition
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("a", "abcdefgh", limit=2) == 3  # stops early above the limit


def _table_distance(a: str, b: str) -> int:
    """The optimal string alignment distance by its full table (the former implementation)."""
    before: list[int] = []
    above = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(above[j] + 1, row[j - 1] + 1, above[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], before[j - 2] + 1)
        before, above = above, row
    return above[-1]


def test_bit_parallel_edit_distance_matches_the_table() -> None:
    """Random short words over small alphabets (many repeats and swaps) and over all letters:
    the same distance as the table, and ``limit + 1`` for any distance above the limit."""
    rng = random.Random(11)
    for _ in range(3000):
        letters = rng.choice(("ab", "abc", "abcd", "abcdefghijklmnopqrstuvwxyz"))
        a = "".join(rng.choice(letters) for _ in range(rng.randint(0, 10)))
        b = "".join(rng.choice(letters) for _ in range(rng.randint(0, 10)))
        exact = _table_distance(a, b)
        assert edit_distance(a, b, limit=20) == exact, (a, b)
        for limit in range(4):
            assert edit_distance(a, b, limit) == min(exact, limit + 1), (a, b, limit)


def _identifier_question(rng: random.Random) -> str:
    token = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3900))
    return f"What does this identifier mean: {token}"


def test_long_identifiers_cost_the_verifier_milliseconds() -> None:
    """One 3,900-letter token on each side (under MAX_SEMANTIC_CHARS): the similarity of the
    substituted words filled a table of 15 million cells, 5 to 12 s of the search thread per
    candidate; bit-parallel, 4,000 letters take about 10 ms."""
    rng = random.Random(3)
    stored, query = _identifier_question(rng), _identifier_question(rng)
    assert len(query) <= MAX_SEMANTIC_CHARS
    verifier = Verifier.load()
    started = time.process_time()
    verifier.assess([stored], [query], [0.9])
    assert time.process_time() - started < 1.0
    assert edit_distance(stored, stored[:-1] + "!", limit=len(stored)) == 1


def test_the_hard_checks_stay_linear_on_long_words_and_spaces() -> None:
    """Two patterns were tried from every character: "per cent" after a run of spaces (the
    operators check: 1 s on 4,000 spaces) and the word before a final period (the shared-text
    check: 0.3-0.9 s on a 3,900-letter word). Anchored, each costs milliseconds."""
    rng = random.Random(5)
    pairs = [
        ("a" + " " * 3990 + "b", "a" + " " * 3990 + "c"),
        (_identifier_question(rng), _identifier_question(rng)),
    ]
    started = time.process_time()
    for stored, query in pairs:
        for _, passes in CHECKS:
            passes(stored, query)
    assert time.process_time() - started < 0.3


def test_typos_are_sought_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each word of one side the other lacks was weighed as a typo of each such word of the
    other: 700 five-letter words a side made 490,000 look-ups (0.7 s per candidate, and as
    much again in the plural check). The search stops after MAX_TYPO_TRIALS pairs."""
    rng = random.Random(9)

    def words() -> str:
        return " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(700))

    trials = 0
    is_typo = cache.diff._is_typo

    def counted(x: Token, y: Token, lexicon: Lexicon) -> bool:
        nonlocal trials
        trials += 1
        return is_typo(x, y, lexicon)

    monkeypatch.setattr(cache.diff, "_is_typo", counted)
    align(words(), words(), Lexicon.shared())
    assert 0 < trials <= MAX_TYPO_TRIALS
    # A real typo in a question is still found.
    assert (
        align(
            "How do I change my password?", "How do I chnage my password?", Lexicon.shared()
        ).typos
        == 1
    )


def test_aligning_texts_of_random_tokens_stays_bounded() -> None:
    """Random hex words (ids, hashes, keys pasted in a prompt) share digits and letters in every
    order: the inversions of shared words grow with the square of the text, and examining each
    for a pivot made the alignment cubic (6.6 KB: 113 s, on the thread every lookup shares).
    The examination stops at MAX_INVERSIONS; the count saturates there."""
    rng = random.Random(7)
    a = " ".join(f"{rng.getrandbits(128):032x}" for _ in range(100))  # 3.3 KB
    b = " ".join(f"{rng.getrandbits(128):032x}" for _ in range(100))
    started = time.process_time()
    diff = align(a, b, Lexicon.shared())
    assert time.process_time() - started < 2.0  # 9.8 s before; ~0.1 s now
    assert diff.content_inversions == MAX_INVERSIONS + 1


def test_repetitive_texts_are_not_aligned_past_the_bound() -> None:
    """difflib weighs every pair of equal words: "a b c " * 400 against "a b d " * 400 took
    4 s (2,000 words: tens of seconds, twice per candidate with the plural check), on the
    search thread every lookup shares. Past MAX_ALIGN_WORK no run is aligned: every shared
    word reads as moved (the verifier's features see a text rearranged)."""
    a, b = "a b c " * 400, "a b d " * 400
    assert MAX_ALIGN_WORK < 400 * 400 * 2
    diff = align(a, b, Lexicon.shared())
    assert len(diff.moved) == 800 and len(diff.substituted) == 400
    # Ordinary prose far below the bound is aligned as before: one run, nothing moved.
    prose = "The committee met on Tuesday to review the annual budget for road repairs. " * 8
    same = align(prose, prose.replace("Tuesday", "Monday", 1), Lexicon.shared())
    assert same.moved == [] and len(same.substituted) == 1
