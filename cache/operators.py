"""Operators and signs: a hard check beside the verifier, for what its words cannot see.

The verifier reads words and numbers (``cache.words``): ``<``, ``>``, ``=``, ``^``, ``*``,
``/`` and a number's minus sign are not words to it, so "Is x > 5 when x = 7?" and "Is x < 5
when x = 7?" look the same (cosine 0.94) and "What is -5 squared?" is "What is 5 squared?".
Teaching the model these symbols would change the features it was trained and calibrated
on; instead the gate (``cache.gate``) refuses a candidate whose operator signature differs
from the question's, after the verifier accepted it. The check can only turn hits into
misses.

The signature is the multiset of:

* each comparison, arithmetic or logical operator written with symbols (``<``, ``>=``,
  ``!=``, ``==``, ``=``, ``+``, ``-``, ``*``, ``/``, ``^``, ``&&``, ``->`` ...) that stands next
  to an operand (a number, a one-letter name such as ``x``, a bracket), with the operands on
  either side: ``x > 5`` is ``("x", ">", "5")``, so swapping which comparison goes with which
  number counts as a change;
* each negative number (``-40``): a minus sign right before a digit, at the start or after a
  space, a bracket, a comma or an operator.

What is not an operator, so that paraphrase hits stay hits: a hyphen or slash with no space
on either side ("state-of-the-art", "e-mail", "x-ray", "COVID-19", "I-70", "A/C", "km/h", a
range "5-10", a date "2024-01-02"; "2/32" and "10:30" are numbers, as ``cache.words`` reads
them), a symbol between two words ("and/or", ``<div>``), a dash ("--", " - " between words)
or a bullet in prose, and all other punctuation. The multiset ignores where in the text each
operator sits, so a reordered question keeps its signature. Symbol spellings of one operator
are one operator (the signs less-than-or-equal, not-equal, times and divided-by of Unicode
are ``<=``, ``!=``, ``*`` and ``/``; ``**`` is ``^``); words ("plus", "greater than") are the
verifier's to read. An unspaced "7-3" or "x/2" is read as a hyphen or slash, which costs the
hit between "7-3" and "7 - 3" (never a false one: "7-3" against "7+3" still differs).
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

# Longest first: "<=" before "<", "**" before "*".
_LEXEME = re.compile(
    r"(?P<space>\s+)"
    r"|(?P<number>\d+(?:[.,:/]\d+)*)"  # as cache.words reads one: "2/32", "10:30"
    r"|(?P<word>[^\W\d_]+)"
    r"|(?P<op>===|!==|\*\*|//|<<|>>|&&|\|\||\+\+|->|<-|=>|<>|!=|[-+*/^<>=]=|[-+*/^<>=])"
    r"|(?P<other>.)",
    re.DOTALL,
)
_SPELLINGS = str.maketrans(
    {"\u2264": "<=", "\u2265": ">=", "\u2260": "!=", "\u00d7": "*", "\u00f7": "/"}
    | {"\u2212": "-", "\u2013": "-", "\u2012": "-"}
)
# With no space on either side these are hyphens and slashes of words and codes ("x-ray",
# "I-70", "W-2", "A/C", "km/h"), not a subtraction or a division.
_SPACED_ONLY = frozenset("-/")
_SAME_OP = {"**": "^", "<>": "!="}
_OPEN = frozenset("([{")
_CLOSE = frozenset(")]}")

Signature = Counter[tuple[str, str, str]]
Lexeme = tuple[str, str, bool]  # kind, value, preceded by a space


@lru_cache(maxsize=1024)  # a stored text is compared with every question near it
def _signature(text: str) -> tuple[tuple[tuple[str, str, str], int], ...]:
    lexemes = _lex(text.translate(_SPELLINGS))
    found: Signature = Counter()
    for i, (kind, value, spaced) in enumerate(lexemes):
        if kind == "neg":
            found[("", "-", value)] += 1
            continue
        if kind != "op":
            continue
        before = lexemes[i - 1] if i > 0 else None
        after = lexemes[i + 1] if i + 1 < len(lexemes) else None
        left, right = _operand(before), _operand(after)
        if value in _SPACED_ONLY:
            if left is None or right is None or not (spaced or (after is not None and after[2])):
                continue
        elif left is None and right is None:
            continue
        found[(left or "", _SAME_OP.get(value, value), right or "")] += 1
    return tuple(sorted(found.items()))


def signature(text: str) -> Signature:
    """The operators and negative numbers of ``text`` (see the module's docstring)."""
    return Counter(dict(_signature(text)))


def same_operators(a: str, b: str) -> bool:
    """True when the two texts write the same operators on the same operands, and the same
    negative numbers; the gate refuses a candidate otherwise."""
    return _signature(a) == _signature(b)


def _lex(text: str) -> list[Lexeme]:
    """(kind, value, preceded by a space) per lexeme, spaces dropped; kinds: number,
    letter (a one-letter word), word, op, neg (a negative number), other."""
    out: list[Lexeme] = []
    spaced = False
    for match in _LEXEME.finditer(text):
        kind = match.lastgroup or "other"
        value = match.group(0)
        if kind == "space":
            spaced = True
            continue
        if kind == "number":
            value = value.replace(",", "")
            if out and out[-1][:2] == ("op", "-") and _signs(out, spaced):
                out[-1] = ("neg", value, out[-1][2])
                spaced = False
                continue
        elif kind == "word":
            kind = "letter" if len(value) == 1 else "word"
            value = value.lower()
        out.append((kind, value, spaced))
        spaced = False
    return out


def _signs(out: list[Lexeme], spaced: bool) -> bool:
    """Is the "-" just lexed (``out[-1]``), with a digit right after it (no space: not
    ``spaced``), a sign? Yes at the start, or after a space, an opening bracket, a comma or
    an operator; no after a word or a number ("COVID-19", "5-10")."""
    if spaced:
        return False
    if len(out) == 1 or out[-1][2]:
        return True
    kind, value, _ = out[-2]
    return kind == "op" or (kind == "other" and (value in _OPEN or value == ","))


def _operand(lexeme: Lexeme | None) -> str | None:
    """The operand a neighbouring lexeme gives an operator: a number, a one-letter name, a
    bracket, a negative number; None for a word, punctuation or nothing."""
    if lexeme is None:
        return None
    kind, value, _ = lexeme
    if kind in ("number", "letter"):
        return value
    if kind == "neg":
        return "-" + value
    if kind == "other" and (value in _OPEN or value in _CLOSE):
        return value
    return None
