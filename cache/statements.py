"""Statements: the second kind of text the gate judges, told apart by the form of the text.

Requests (questions, commands, search-box fragments, what users type to an assistant) and
their near misses differ in one to three words, and the request gate reads those words.
Statements (declarative prose: news, reports, a user pasting a paragraph) are paraphrased by
rewording broadly, moving clauses and adding asides, and are told apart by whether one side
adds or changes a fact. The request gate, trained to read few heavy changes as "another
question", rejects many such paraphrases and is not precise on them (0.93 out of fold on the
news pairs at its threshold), so statement pairs get a model of their own
(``cache.verifier.StatementModel``) with its own calibration, targeted at precision.

``is_statement`` is a rule on the text's form, not a model: at least ``MIN_WORDS`` words;
starts like a sentence (capital, digit or quote) and ends like one (``.``, ``!`` or a closing
quote); not a question (``?`` at the end, or a wh-word or an auxiliary first: "How", "Can't");
not an imperative (a first word that is only a verb in WordNet, or a verb followed by a
determiner or pronoun: "Write a ...", "Format the ..."); no "tool: ..." prefix ("pandas: drop
rows"); no "you", "your" or "please" outside quotation marks. A text of several sentences is
read by its first and its last: a pasted paragraph followed by "Translate the text above into
French." or "Question: who chaired the meeting?" is a request about a text, not a statement. A pair is a statement pair when
both texts are statements. Of the 6,000 real user requests the perturbations start from, 160
(2.7%) read as statements.

``statement_features`` adds what the request features do not say about broad rewrites:
shared word 2-, 3- and 4-grams (as a share of each side's), the longest common word
subsequence, and the words only one side has (content words with no base form on the other
side): how many, how many of them are inflected verbs (an added clause: "... and he
immediately appealed"), capitalised names or numbers, and the largest share of a side they
make up.
"""

from __future__ import annotations

import re

from cache.lexicon import Lexicon
from cache.segments import abbreviated
from cache.surface import STOPWORDS

MIN_WORDS = 8
MIN_LAST_WORDS = 3

_QUESTION_FIRST = frozenset(
    [
        *("how", "what", "what's", "whats", "which", "who", "whom", "whose", "why", "when"),
        *("where", "is", "are", "am", "was", "were", "can", "could", "should", "would"),
        *("will", "shall", "may", "might", "do", "does", "did", "have", "has"),
        *("can't", "cannot", "don't", "doesn't", "didn't", "won't", "wouldn't", "isn't"),
        *("aren't", "wasn't", "weren't", "shouldn't", "couldn't", "haven't", "hasn't"),
    ]
)
# After an imperative verb: its object's determiner or a pronoun ("Show the ...", "Plan a ...").
_OBJECT_START = frozenset(
    [
        *("the", "a", "an", "this", "that", "these", "those", "all", "every", "each", "some"),
        *("any", "no", "my", "me", "us", "it", "them", "our", "your", "his", "her", "their"),
    ]
)
_ADDRESSEE = re.compile(r"\b(?:you|your|yours|you're|you've|you'll|please|pls|plz)\b", re.I)
_QUOTED = re.compile(r"\"[^\"]*\"|\u201c[^\u201d]*\u201d")
_TOKEN = re.compile(r"[A-Za-z][\w'\u2019-]*|\d+")
_TOOL_PREFIX = re.compile(r"^[\w.+#-]+(?: [\w.+#-]+)?:\s")
_ENDS_SENTENCE = re.compile(r"[.!\"\u201d'\u2019)]$")
_WORD = re.compile(r"[A-Za-z]+|\d+(?:[.,]\d+)*")
# Where a sentence ends: ".", "!" or "?" before a capital, and a line break.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"\u201c])|\n+")


def is_statement(text: str, lex: Lexicon) -> bool:
    s = text.strip()
    if len(s.split()) < MIN_WORDS:
        return False
    if not (s[0].isupper() or s[0].isdigit() or s[0] in "\"\u201c'\u2018("):
        return False
    if not _ENDS_SENTENCE.search(s) or s.rstrip("\"\u201d'\u2019) ").endswith("?"):
        return False
    last = _last_sentence(s)
    if last is not None and not _declarative(last, lex):
        return False
    return _declarative(s, lex)


def _last_sentence(text: str) -> str | None:
    """The text's last sentence of ``MIN_LAST_WORDS`` words or more, when it has more than
    one (a period after an initial or an abbreviation ends none: ``cache.segments``)."""
    ends = [
        m.end()
        for m in _SENTENCE_BREAK.finditer(text)
        if "\n" in m.group(0) or not abbreviated(text[: m.start()])
    ]
    if not ends:
        return None
    last = text[ends[-1] :].strip()
    return last if len(last.split()) >= MIN_LAST_WORDS else None


def _declarative(s: str, lex: Lexicon) -> bool:
    """Not a question, an imperative, a "label: ..." line or addressed to the reader."""
    tokens = _TOKEN.findall(s)
    if not tokens:
        return False
    first = tokens[0].lower().replace("\u2019", "'")
    if first in _QUESTION_FIRST or _TOOL_PREFIX.match(s):
        return False
    verbs, nouns = lex.pos_lemmas.get("v", set()), lex.pos_lemmas.get("n", set())
    if first in verbs and (
        first not in nouns or (len(tokens) > 1 and tokens[1].lower() in _OBJECT_START)
    ):
        return False
    return not _ADDRESSEE.search(_QUOTED.sub(" ", s))


def statement_pair(a: str, b: str, lex: Lexicon) -> bool:
    return is_statement(a, lex) and is_statement(b, lex)


STATEMENT_FEATURE_NAMES: tuple[str, ...] = (
    "bigram_min",
    "bigram_max",
    "trigram_min",
    "trigram_max",
    "fourgram_min",
    "fourgram_max",
    "lcs_longer",
    "lcs_shorter",
    "only_words_max",
    "only_words_min",
    "only_verbs_max",
    "only_verbs_min",
    "only_names_max",
    "only_names_min",
    "only_numbers_max",
    "only_numbers_min",
    "only_share_max",
)


def _grams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists, bit-parallel (Allison and
    Dix; Hyyrö): bit i of ``row`` is 0 where the LCS gains a word at ``a[i]``; one big-integer
    add per word of ``b`` instead of a pass over ``a``."""
    masks: dict[str, int] = {}
    for i, word in enumerate(a):
        masks[word] = masks.get(word, 0) | (1 << i)
    full = (1 << len(a)) - 1
    row = full
    for word in b:
        match = row & masks.get(word, 0)
        row = ((row + match) | (row - match)) & full
    return len(a) - row.bit_count()


def _inflected_verb(word: str, lex: Lexicon) -> bool:
    """An inflected verb form ("appealed", "leaving", "says", "won"): a new predicate."""
    if word in STOPWORDS:
        return False
    verbs = lex.pos_lemmas.get("v", set())
    if word in lex.exceptions.get("v", {}):
        return True
    return word.endswith(("ed", "ing", "s")) and any(f in verbs for f in lex.forms(word))


def _only(raw: list[str], other: set[str], lex: Lexicon) -> tuple[int, int, int, int]:
    """Content words of one side with no base form on the other: all, verbs, names, numbers."""
    words = [
        (r, w)
        for r, w in ((r, r.lower()) for r in raw)
        if w not in STOPWORDS and not (lex.forms(w) & other)
    ]
    return (
        len(words),
        sum(_inflected_verb(w, lex) for _, w in words),
        sum(r[0].isupper() for r, _ in words),
        sum(w[0].isdigit() for _, w in words),
    )


def statement_features(a: str, b: str, lex: Lexicon) -> list[float]:
    """Features of a pair in ``STATEMENT_FEATURE_NAMES`` order."""
    raw_a, raw_b = _WORD.findall(a), _WORD.findall(b)
    wa, wb = [w.lower() for w in raw_a], [w.lower() for w in raw_b]
    out: list[float] = []
    for n in (2, 3, 4):
        ga, gb = _grams(wa, n), _grams(wb, n)
        shared = len(ga & gb)
        pa, pb = shared / max(len(ga), 1), shared / max(len(gb), 1)
        out += [min(pa, pb), max(pa, pb)]
    common = _lcs(wa, wb)
    out += [common / max(len(wa), len(wb), 1), common / max(min(len(wa), len(wb)), 1)]
    keys_a = {f for w in set(wa) for f in lex.forms(w)}
    keys_b = {f for w in set(wb) for f in lex.forms(w)}
    only_a, only_b = _only(raw_a, keys_b, lex), _only(raw_b, keys_a, lex)
    for x, y in zip(only_a, only_b, strict=True):
        out += [float(max(x, y)), float(min(x, y))]
    out.append(max(only_a[0] / max(len(wa), 1), only_b[0] / max(len(wb), 1)))
    return out
