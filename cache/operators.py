"""Operators and signs: a hard check beside the verifier, for what its words cannot see.

The verifier reads words and numbers (``cache.words``): ``<``, ``>``, ``=``, ``^``, ``*``,
``/`` and a number's minus sign are not words to it, so "Is x > 5 when x = 7?" and "Is x < 5
when x = 7?" look the same (cosine 0.94) and "What is -5 squared?" is "What is 5 squared?".
Teaching the model these symbols would change the features it was trained and calibrated
on; instead the gate (``cache.gate``) refuses a candidate whose operator signature differs
from the question's, after the verifier accepted it. The check can only turn hits into
misses.

The signature is the multiset of:

* each operator or symbol: comparison, arithmetic, logical, assignment, shift and redirection
  operators written with ASCII symbols (``<``, ``>=``, ``>>``, ``!=``, ``===``, ``=``, ``+=``,
  ``+``, ``*``, ``^``, ``&&``, ``||``, ``|``, ``~``, ``%``, ``->`` ...), a colon written inside
  code (unspaced on both sides: the slice ``items[1:]``, ``std::vector``), and every Unicode
  mathematical, currency or other symbol (categories Sm, Sc, So: arrows, ``≫``, ``⩾``,
  ``€``, emoji), each with the operands on either side: a number, a one-letter name such
  as ``x``, a bracket, or nothing for a longer word. ``x > 5`` is ``("x", ">", "5")``, so
  swapping which comparison goes with which number counts as a change, and ``null ==
  undefined`` is ``("", "==", "")``, which differs from ``null === undefined``;
* each negative number (``-40``): a minus sign right before a digit, at the start or after a
  space, a bracket, a comma or an operator.

What is not an operator, so that paraphrase hits stay hits: a hyphen, slash or ampersand with
no space on either side, or between two words ("state-of-the-art", "e-mail", "x-ray",
"COVID-19", "I-70", "A/C", "km/h", "and/or", "R&D", "Tom & Jerry", a range "5-10", a date
"2024-01-02"; "2/32" and "10:30" are numbers, as ``cache.words`` reads them), a dash ("--",
" - " between words) or a bullet at the start of a line, a colon followed by a space, and all
other punctuation (``.``, ``,``, ``?``, ``!``, quotes, brackets on their own). The multiset
ignores where in the text each operator sits, so a reordered question keeps its signature.
Symbol spellings of one operator are one operator (Unicode's less-than-or-equal signs, the
slanted ones included, not-equal, times, divided-by, the arrows and the full-width forms are
``<=``, ``!=``, ``*``, ``/``, ``->``, ``+`` ...; ``**`` is ``^``); words ("plus", "greater
than") are the verifier's to read. An unspaced "7-3" or "x/2" is read as a hyphen or slash,
which costs the hit between "7-3" and "7 - 3" (never a false one: "7-3" against "7+3" still
differs).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from functools import lru_cache

# Longest first: "<=" before "<", "**" before "*", ">>=" before ">>".
_LEXEME = re.compile(
    r"(?P<space>\s+)"
    r"|(?P<number>\d+(?:[.,:/]\d+)*)"  # as cache.words reads one: "2/32", "10:30"
    r"|(?P<word>[^\W\d_]+)"
    r"|(?P<op>===|!==|<=>|<->|<<=|>>=|\*\*|//|::|<<|>>|&&|\|\||\+\+|->|<-|=>|<>|!="
    r"|[-+*/^<>=%&|~]=|[-+*/^<>=%&|~:])"
    r"|(?P<other>.)",
    re.DOTALL,
)
_SPELLINGS = str.maketrans(
    {"\u2264": "<=", "\u2265": ">=", "\u2a7d": "<=", "\u2a7e": ">=", "\u2266": "<=", "\u2267": ">="}
    | {"\u2260": "!=", "\u00d7": "*", "\u2217": "*", "\u22c5": "*", "\u00f7": "/", "\u2215": "/"}
    | {"\u2212": "-", "\u2013": "-", "\u2012": "-"}
    | {"\u2192": "->", "\u27f6": "->", "\u2190": "<-", "\u27f5": "<-", "\u21d2": "=>"}
    | {"\u27f9": "=>", "\u2194": "<->", "\u21d4": "<=>", "\u27fa": "<=>"}
    # Full-width forms of the ASCII operators (an East Asian keyboard's "5 \uff0b 3").
    | {chr(0xFF01 + i): chr(0x21 + i) for i in range(0x5E) if chr(0x21 + i) in "+-*/^<>=%&|~"}
)
# With no space on either side, or between two words, these are hyphens, slashes and
# ampersands of words and codes ("x-ray", "I-70", "W-2", "A/C", "km/h", "R&D", "Tom & Jerry"),
# or a dash in prose, not a subtraction, a division or a conjunction.
_SPACED_ONLY = frozenset("-/&")
# A line that starts with one of these and a space is a list item, not an operation.
_BULLETS = frozenset("-*+")
# Signs of a unit rather than operators: whether the text writes one counts, not its operand.
_UNIT_SIGNS = frozenset("%")
# The spaces before "per cent" go with it; the match starts only where a run of spaces does
# (tried from inside one, the run would be scanned again from every space: quadratic).
_PERCENT = re.compile(r"(?<!\s)\s*\bper\s?cent\b", re.IGNORECASE)
_SAME_OP = {"**": "^", "<>": "!="}
_OPEN = frozenset("([{")
_CLOSE = frozenset(")]}")
# Unicode categories whose every character is a symbol the verifier cannot read: math (arrows,
# comparisons), currency, other symbols (degree sign, emoji).
_SYMBOL_CATEGORIES = frozenset(("Sm", "Sc", "So"))

Signature = Counter[tuple[str, str, str]]
Lexeme = tuple[str, str, bool]  # kind, value, preceded by a space


@lru_cache(maxsize=1024)  # a stored text is compared with every question near it
def _signature(text: str) -> tuple[tuple[tuple[str, str, str], int], ...]:
    lexemes = _lex(_PERCENT.sub("%", text.translate(_SPELLINGS)))
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
        elif value == ":" and (spaced or after is None or after[2]):
            continue  # "Question: who ...", "Note:" (a label, not code)
        elif _bullet(value, before, after):
            continue  # "* item" at the start of a line
        if value in _UNIT_SIGNS or unicodedata.category(value[0]) == "Sc":
            found[("", value, "")] = 1  # "$3" / "$4", "5%" / "6%": the numbers are the verifier's
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
    """(kind, value, preceded by a space) per lexeme, spaces dropped (a line break leaves an
    ``nl`` lexeme: where a bullet may stand); kinds: number, letter (a one-letter word), word,
    op (an operator or a symbol), neg (a negative number), other."""
    out: list[Lexeme] = []
    spaced = False
    for match in _LEXEME.finditer(text):
        kind = match.lastgroup or "other"
        value = match.group(0)
        if kind == "space":
            if "\n" in value and out:
                out.append(("nl", "", True))
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
        elif kind == "other" and unicodedata.category(value) in _SYMBOL_CATEGORIES:
            kind = "op"
        out.append((kind, value, spaced))
        spaced = False
    return out


def _bullet(value: str, before: Lexeme | None, after: Lexeme | None) -> bool:
    starts_line = before is None or before[0] == "nl"
    return value in _BULLETS and starts_line and after is not None and after[2]


def _signs(out: list[Lexeme], spaced: bool) -> bool:
    """Is the "-" just lexed (``out[-1]``), with a digit right after it (no space: not
    ``spaced``), a sign? Yes at the start, or after a space, an opening bracket, a comma or
    an operator; no after a word or a number ("COVID-19", "5-10")."""
    if spaced:
        return False
    if len(out) == 1 or out[-1][2]:
        return True
    kind, value, _ = out[-2]
    return kind in ("op", "nl") or (kind == "other" and (value in _OPEN or value == ","))


def _operand(lexeme: Lexeme | None) -> str | None:
    """The operand a neighbouring lexeme gives an operator: a number, a one-letter name, a
    bracket, a negative number; None for a word, punctuation, a line break or nothing."""
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
