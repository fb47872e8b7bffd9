"""Surface overlap features of a pair: what the first verifier read (word and character
overlap, numbers, negations and capitalised names on one side only, and the longest runs of
words one side lacks). News-sentence pairs (MRPC) are told apart mostly by these: a
"paraphrase" that adds a clause ("... until elections can be held") is not one.
"""

from __future__ import annotations

import math
import re

_WORD = re.compile(r"[A-Za-z]+|\d+(?:[.,]\d+)*")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NAME = re.compile(r"[A-Za-z][\w'-]*")
_NEGATION = re.compile(
    r"\b(?:not|no|never|none|nobody|nothing|neither|nor|without|cannot)\b|n(?:'|\u2019)t\b",
    re.IGNORECASE,
)
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "at",
        "for",
        "by",
        "with",
        "from",
        "and",
        "or",
        "but",
        "as",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "he",
        "she",
        "they",
        "them",
        "his",
        "her",
        "their",
        "we",
        "our",
        "you",
        "your",
        "i",
        "me",
        "my",
        "has",
        "have",
        "had",
        "do",
        "does",
        "did",
        "will",
        "would",
        "can",
        "could",
        "should",
        "may",
        "might",
        "shall",
        "which",
        "who",
        "whom",
        "whose",
        "what",
        "when",
        "where",
        "why",
        "how",
        "than",
        "then",
        "there",
        "here",
        "also",
        "s",
        "said",
        "says",
    ]
)

SURFACE_NAMES: tuple[str, ...] = (
    "word_jaccard",
    "word_overlap_min",
    "word_overlap_max",
    "char3_jaccard",
    "number_mismatch",
    "number_diff_ratio",
    "has_numbers",
    "negation_mismatch",
    "negation_count_diff",
    "name_diff_ratio",
    "name_mismatch",
    "length_ratio",
    "log_length_diff",
    "content_only_stored",
    "content_only_query",
    "content_only_max",
    "content_only_min",
    "content_only_stored_frac",
    "content_only_query_frac",
    "content_jaccard",
    "run_max",
    "run_min",
    "content_run_max",
    "content_run_min",
    "tail_run_max",
    "run_query",
    "content_run_query",
    "number_substitution",
    "name_substitution",
)


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _names(text: str) -> set[str]:
    # Capitalised words after the first: a crude but cheap proper-name detector.
    words = _NAME.findall(text)
    return {w.lower() for w in words[1:] if w[0].isupper()}


def _char_grams(words: list[str], n: int = 3) -> set[str]:
    joined = " ".join(words)
    return {joined[i : i + n] for i in range(max(len(joined) - n + 1, 1))}


def _negations(text: str) -> int:
    return len(_NEGATION.findall(text))


def _runs(words: list[str], other: set[str]) -> tuple[int, int, int]:
    """Longest run of words missing from ``other``, the same counting content words only,
    and the length of the missing run at the end."""
    best = current = content_best = content_current = 0
    for word in words:
        if word in other:
            current = content_current = 0
            continue
        current += 1
        best = max(best, current)
        if word not in STOPWORDS:
            content_current += 1
            content_best = max(content_best, content_current)
    tail = 0
    for word in reversed(words):
        if word in other:
            break
        tail += 1
    return best, content_best, tail


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def surface_features(stored: str, query: str) -> list[float]:
    """Features of one (stored text, new query) pair, in ``SURFACE_NAMES`` order."""
    wa, wb = _words(stored), _words(query)
    sa, sb = set(wa), set(wb)
    common = len(sa & sb)
    na = {n.replace(",", "") for n in _NUMBER.findall(stored)}
    nb = {n.replace(",", "") for n in _NUMBER.findall(query)}
    ma, mb = _names(stored), _names(query)
    ga, gb = _char_grams(wa), _char_grams(wb)
    neg_a, neg_b = _negations(stored), _negations(query)
    ca = {w for w in sa if w not in STOPWORDS}
    cb = {w for w in sb if w not in STOPWORDS}
    only_a, only_b = len(ca - cb), len(cb - ca)
    run_a, content_run_a, tail_a = _runs(wa, sb)
    run_b, content_run_b, tail_b = _runs(wb, sa)
    return [
        _ratio(common, len(sa | sb)),
        _ratio(common, min(len(sa), len(sb))),
        _ratio(common, max(len(sa), len(sb))),
        _ratio(len(ga & gb), len(ga | gb)),
        float(na != nb),
        _ratio(len(na ^ nb), len(na | nb)),
        float(bool(na or nb)),
        float(neg_a % 2 != neg_b % 2),
        float(abs(neg_a - neg_b)),
        _ratio(len(ma ^ mb), len(ma | mb)),
        float(ma != mb),
        _ratio(min(len(wa), len(wb)), max(len(wa), len(wb))),
        math.log1p(abs(len(wa) - len(wb))),
        float(only_a),
        float(only_b),
        float(max(only_a, only_b)),
        float(min(only_a, only_b)),
        _ratio(only_a, len(ca)),
        _ratio(only_b, len(cb)),
        _ratio(len(ca & cb), len(ca | cb)),
        float(max(run_a, run_b)),
        float(min(run_a, run_b)),
        float(max(content_run_a, content_run_b)),
        float(min(content_run_a, content_run_b)),
        float(max(tail_a, tail_b)),
        float(run_b),
        float(content_run_b),
        float(bool(na - nb) and bool(nb - na)),
        float(bool(ma - mb) and bool(mb - ma)),
    ]
