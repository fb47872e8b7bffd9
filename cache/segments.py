"""Shared text: a hard check beside the verifier for requests built around the same passage.

"<a pasted text> Translate the text above into French." and "... into German.", "Summarize:
<text>" and "Translate to Japanese: <text>", "<text> Question: who chaired the meeting?" and
"... who was absent?": the pasted text makes both the embedding (0.88-0.99 cosine) and the
verifier's features (a few changed words among hundreds of shared ones) say "the same", and
the statement gate, reading shared n-grams, agrees. The question is in the part that differs,
however short, so that part is judged alone, and strictly.

Each text is cut into segments: sentences (ending with ``.``, ``!`` or ``?`` and a space; a
period after an initial, "U.S", or a short abbreviation, "Inc.", "Mr.", "No. 2", "Sept.",
ends none), lines, and what stands before a colon ("Summarize:", "Question:", "Translate to
Japanese:"). A segment
both texts contain (compared as lower-case words; at least ``MIN_SHARED_WORDS`` words) is
shared text. When there is any, the segments that are not shared, in order, are aligned
(``cache.diff``) and the pair is refused unless every difference between them is one that
does not change a request:

* the surface: case, contractions, typos, split or joined words, moved words (but not a swap
  around a pivot: "who killed Abel" / "who did Abel kill");
* determiners and fillers ("the"/"this", "just", "please");
* a content word replaced by a synonym (a shared dominant WordNet sense: "big"/"large").

Any other changed word refuses: a content word, a number, a negation, a preposition, a
quantifier, a wh-word, a modal, a pronoun, an auxiliary; so does a segment only one side has
("<text>" / "<text> Write a poem about the text above."). A change inside the passage itself
("... The budget was approved." / "... rejected.") is a different question too, and refused
the same way. Pairs with no shared segment (single questions, news sentences that reword
broadly) are left to the verifier. The check can only turn hits into misses.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

from cache.diff import align
from cache.lexicon import Lexicon
from cache.pairfeatures import relation
from cache.words import DETERMINER, DISCOURSE, Token

MIN_SHARED_WORDS = 3

_BOUNDARY = re.compile(r"(?<=[!?:])\s+|(?<=\.)\s+(?=\S)|\n+")
# A period after one of these (or after a single letter, or a capitalised word of at most
# four letters: "Inc", "Corp", "Rep", "Sept") abbreviates, and ends no sentence.
_ABBREVIATIONS = frozenset(("etc", "vs", "approx", "calif", "prof", "capt", "dept", "univ"))
_WORD_BEFORE = re.compile(r"([^\W\d_]+)\.$")
# Only a word of at most six letters abbreviates, so the end of a part decides: a window one
# letter longer shows such a word whole and any longer word as too long. Searched from the
# start, the pattern would scan a long word once from each of its letters (quadratic).
_TAIL = max(map(len, _ABBREVIATIONS)) + 2
_WORD = re.compile(r"[^\W_]+")
_HARMLESS = DETERMINER | DISCOURSE


@lru_cache(maxsize=1024)  # a stored text is compared with every question near it
def segments(text: str) -> tuple[tuple[str, str], ...]:
    """(segment as written, its lower-case words joined by spaces) per segment with words."""
    out: list[tuple[str, str]] = []
    pending = ""
    for part in _BOUNDARY.split(text):
        pending = f"{pending} {part}" if pending else part
        if abbreviated(pending):
            continue
        words = " ".join(_WORD.findall(pending.lower()))
        if words:
            out.append((pending, words))
        pending = ""
    words = " ".join(_WORD.findall(pending.lower()))
    if words:
        out.append((pending, words))
    return tuple(out)


def abbreviated(part: str) -> bool:
    """Does ``part`` end with an abbreviation's period rather than a sentence's?"""
    found = _WORD_BEFORE.search(part, max(len(part) - _TAIL, 0))
    if found is None:
        return False
    word = found.group(1)
    if len(word) == 1 or word.lower() in _ABBREVIATIONS:
        return True
    return len(word) <= 4 and word[0].isupper() and not word.isupper()


def _rest(parts: tuple[tuple[str, str], ...], shared: Counter[str]) -> str:
    """The segments not taken by ``shared`` (each shared segment taken once per copy)."""
    left = Counter(shared)
    kept: list[str] = []
    for written, words in parts:
        if left[words] > 0:
            left[words] -= 1
        else:
            kept.append(written)
    return " ".join(kept)


def shared_segments(a: str, b: str) -> Counter[str]:
    common = Counter(w for _, w in segments(a)) & Counter(w for _, w in segments(b))
    return Counter({w: n for w, n in common.items() if len(w.split()) >= MIN_SHARED_WORDS})


def _harmless(x: Token, y: Token | None, lex: Lexicon) -> bool:
    if y is None:
        return x.norm in _HARMLESS
    if x.norm in _HARMLESS and y.norm in _HARMLESS:
        return True
    if x.is_number or y.is_number or not (x.is_content and y.is_content):
        return False
    return relation(x, y, lex) == "synonym"


def same_instruction(a: str, b: str, lex: Lexicon | None = None) -> bool:
    """True unless the texts share a segment and differ elsewhere by more than the surface, a
    determiner or a synonym (see the module's docstring); the gate refuses a candidate then."""
    shared = shared_segments(a, b)
    if not shared:
        return True
    rest_a, rest_b = _rest(segments(a), shared), _rest(segments(b), shared)
    if not rest_a and not rest_b:
        return True
    lexicon = lex or Lexicon.shared()
    diff = align(rest_a, rest_b, lexicon)
    if diff.pivot_swaps:
        return False
    if not all(_harmless(t, None, lexicon) for t in (*diff.deleted, *diff.inserted)):
        return False
    return all(_harmless(x, y, lexicon) for x, y in diff.substituted)
