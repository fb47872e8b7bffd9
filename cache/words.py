"""Words as the cache gate reads them: tokens, normalisation and closed word classes.

A request is split into words and numbers; each word is lower-cased, contractions are
expanded ("don't" -> "do not", "what's" -> "what is"; a possessive "'s" is dropped), number
words and ordinals become digits ("five" -> "5", "fifth" and "5th" -> "5"), courtesy words ("please", "thanks", "hi") are dropped,
the question frames "how do I", "how can I", "how should we" ... read as "how to", and each
word gets an alignment key: its WordNet base
form ("files" -> "file", "succeeded" -> "succeed"; acronyms are left alone), so inflection is
never a change. "is" and "has" share a key, since "'s" may be either.

The closed classes (negation, relation words, quantifiers, modals, wh-words, pronouns,
auxiliaries, determiners, conjunctions, discourse fillers) are English grammar, not fitted to
any data set: the gate needs to know which changed words carry the request's logic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cache.lexicon import Lexicon

_TOKEN = re.compile(
    r"\d+(?:[.,:/]\d+)*(?:st|nd|rd|th)?|[^\W\d_]+(?:['\u2019][^\W\d_]+)*|[$€£%#+&@]"
)

_CONTRACTIONS = {
    "can't": ["can", "not"],
    "cannot": ["can", "not"],
    "won't": ["will", "not"],
    "shan't": ["shall", "not"],
    "ain't": ["is", "not"],
    "let's": ["let", "us"],
    "gonna": ["going", "to"],
    "wanna": ["want", "to"],
    "gotta": ["got", "to"],
}
_SUFFIXES = {"n't": ["not"], "'re": ["are"], "'ve": ["have"], "'ll": ["will"], "'d": ["would"]}
_SUFFIXES.update({"'m": ["am"]})
# "'s" is "is" after these words ("what's", "it's"), else a possessive and dropped.
_IS_HOSTS = frozenset(
    [
        "what",
        "where",
        "who",
        "when",
        "why",
        "how",
        "it",
        "that",
        "there",
        "here",
        "he",
        "she",
        "this",
        "which",
        "everyone",
        "nobody",
    ]
)

_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60"})
_NUMBER_WORDS.update({"seventy": "70", "eighty": "80", "ninety": "90", "hundred": "100"})
_NUMBER_WORDS.update({"thousand": "1000", "million": "1e6", "billion": "1e9", "dozen": "12"})
# Ordinals read as their numbers, as "3rd" is: "fifth grade" / "seventh grade" is a changed
# number, "third" / "3rd" is none. "first" stays a quantifier ("first" / "last"), and
# "second" is read as 2 only in the singular ("30 seconds" is a unit).
_ORDINAL_WORDS = [
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
]
_NUMBER_WORDS.update({w: str(i) for i, w in enumerate(_ORDINAL_WORDS, start=2)})
_NUMBER_WORDS.update({"thirtieth": "30", "fortieth": "40", "fiftieth": "50", "sixtieth": "60"})
_NUMBER_WORDS.update({"seventieth": "70", "eightieth": "80", "ninetieth": "90"})
_NUMBER_WORDS.update({"hundredth": "100", "thousandth": "1000"})

# Closed word classes of English grammar (not fitted to any data set): the gate needs to know
# which changed words carry the request's logic rather than its topic.
NEGATION = frozenset(
    ["not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without"]
)
RELATION = frozenset(
    [
        "to",
        "from",
        "into",
        "onto",
        "in",
        "on",
        "at",
        "by",
        "for",
        "of",
        "with",
        "over",
        "under",
        "above",
        "below",
        "before",
        "after",
        "up",
        "down",
        "out",
        "off",
        "than",
        "between",
        "through",
        "via",
        "per",
        "toward",
        "towards",
        "against",
        "inside",
        "outside",
        "within",
        "across",
        "along",
        "behind",
        "beyond",
        "near",
    ]
)
QUANTIFIER = frozenset(
    [
        "all",
        "every",
        "each",
        "any",
        "some",
        "one",
        "single",
        "whole",
        "entire",
        "only",
        "both",
        "either",
        "first",
        "last",
        "many",
        "much",
        "few",
        "several",
        "most",
        "least",
        "more",
        "less",
        "fewer",
        "other",
        "another",
        "same",
        "different",
    ]
)
MODAL = frozenset(
    ["can", "could", "may", "might", "must", "shall", "should", "will", "would", "need", "ought"]
)
WH = frozenset(["who", "whom", "whose", "what", "which", "when", "where", "why", "how"])
PRONOUN = frozenset(
    [
        "i",
        "me",
        "my",
        "mine",
        "myself",
        "you",
        "your",
        "yours",
        "yourself",
        "he",
        "him",
        "his",
        "she",
        "her",
        "hers",
        "it",
        "its",
        "we",
        "us",
        "our",
        "ours",
        "they",
        "them",
        "their",
        "theirs",
        "someone",
        "somebody",
    ]
)
AUXILIARY = frozenset(
    [
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "do",
        "does",
        "did",
        "have",
        "has",
        "had",
    ]
)
DETERMINER = frozenset(["a", "an", "the", "this", "that", "these", "those"])
CONJUNCTION = frozenset(
    ["and", "or", "but", "so", "if", "then", "because", "while", "whether", "nor", "vs", "versus"]
)
DISCOURSE = frozenset(
    [
        "please",
        "kindly",
        "thanks",
        "thank",
        "hi",
        "hello",
        "hey",
        "dear",
        "just",
        "really",
        "actually",
        "basically",
        "even",
        "yo",
        "well",
        "also",
        "s",
        "like",
    ]
)
FUNCTION = (
    (NEGATION | RELATION | QUANTIFIER | MODAL | WH | PRONOUN | AUXILIARY | DETERMINER)
    | CONJUNCTION
    | DISCOURSE
)
# Courtesy words carry no request content and are dropped before alignment.
COURTESY = frozenset(["please", "kindly", "thanks", "thank", "hi", "hello", "hey", "dear", "yo"])
_FRAME_VERBS = frozenset(["do", "does", "can", "could", "should", "would", "might", "may"])
_FRAME_SUBJECTS = frozenset(["i", "we", "you", "one"])
SYMMETRIC_PIVOTS = frozenset(["and", "or", "vs", "versus", "&"])


@dataclass(frozen=True, slots=True)
class Token:
    surface: str  # as typed (after contraction expansion)
    norm: str  # lower case, number words as digits
    key: str  # alignment key: base form, or the other side's key for a matched typo
    position: int  # index in the original word sequence (before expansion)
    capitalised: bool  # capital letter not at the start of the text

    @property
    def is_number(self) -> bool:
        return self.norm[:1].isdigit()

    @property
    def is_function(self) -> bool:
        return self.norm in FUNCTION

    @property
    def is_content(self) -> bool:
        return not self.is_function and self.norm not in "$€£%#+&@"


def _expand(word: str) -> list[str]:
    lower = word.lower().replace("\u2019", "'")
    if lower in _CONTRACTIONS:
        return _CONTRACTIONS[lower]
    if "'" in lower:
        for suffix, repl in _SUFFIXES.items():
            if lower.endswith(suffix) and len(lower) > len(suffix):
                stem = lower[: -len(suffix)]
                return [*_expand_stem(stem, suffix), *repl]
        if lower.endswith("'s"):
            stem = lower[:-2]
            return [stem, "is"] if stem in _IS_HOSTS else [stem]
        return [lower.replace("'", "")]
    return [lower]


def _expand_stem(stem: str, suffix: str) -> list[str]:
    if suffix == "n't":
        fixed = {"ca": "can", "wo": "will", "sha": "shall", "ai": "is"}
        return [fixed.get(stem, stem)]
    return [stem]


def _number(text: str) -> str:
    digits = text.replace(",", "")
    for suffix in ("st", "nd", "rd", "th"):
        if digits.endswith(suffix) and digits[:-2].isdigit():
            return digits[:-2]
    return digits


def tokenize(text: str, lexicon: Lexicon) -> list[Token]:
    out: list[Token] = []
    for position, match in enumerate(_TOKEN.finditer(text)):
        raw = match.group(0)
        capitalised = position > 0 and raw[:1].isupper() and not raw.isupper()
        if raw[:1].isdigit():
            value = _number(raw)
            out.append(Token(raw, value, value, position, False))
            continue
        for part in _expand(raw):
            if not part:
                continue
            norm = _NUMBER_WORDS.get(part, part)
            # Acronyms ("HTTPS") are not plurals of anything.
            if norm in ("is", "has"):
                key = "is|has"  # "'s" is either; the aligner need not decide which
            elif norm.isalpha() and len(norm) > 2 and norm not in FUNCTION and not raw.isupper():
                bases = lexicon.lemmas(norm)
                key = bases[0] if bases else norm
            else:
                key = norm
            if norm in COURTESY:
                continue  # "please", "thanks", "hi": no request is about them
            out.append(Token(raw, norm, key, position, capitalised))
    return _how_frames(out)


def _how_frames(tokens: list[Token]) -> list[Token]:
    """ "how do I", "how can I", "how should we" ... -> "how to": one question frame."""
    out: list[Token] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if (
            t.norm == "how"
            and i + 2 < len(tokens)
            and tokens[i + 1].norm in _FRAME_VERBS
            and tokens[i + 2].norm in _FRAME_SUBJECTS
        ):
            out.append(t)
            nxt = tokens[i + 1]
            out.append(Token(nxt.surface, "to", "to", nxt.position, False))
            i += 3
            continue
        out.append(t)
        i += 1
    return out


def edit_distance(a: str, b: str, limit: int = 3) -> int:
    """Damerau-Levenshtein distance (adjacent transpositions, each substring edited once: the
    "optimal string alignment" distance), or ``limit + 1`` when it is above ``limit``.

    Bit-parallel (Hyyro, 2003, after Myers, 1999): bit i of ``up`` / ``down`` says the
    distance from ``a[: i + 1]`` rises / falls by one against ``a[:i]`` in the current column
    of the table; one pass of a few big-integer operations per character of ``b`` replaces a
    row of ``len(a)`` cells. A pair of 4,000-letter identifiers costs milliseconds, not the
    seconds a table of 16 million cells took on the cache's search thread."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    if not a or not b:
        return min(len(a) + len(b), limit + 1)
    positions: dict[str, int] = {}
    for i, char in enumerate(a):
        positions[char] = positions.get(char, 0) | (1 << i)
    full = (1 << len(a)) - 1
    last = 1 << (len(a) - 1)
    up, down, diagonal, previous = full, 0, 0, 0
    distance = len(a)
    for char in b:
        match = positions.get(char, 0)
        # A transposition: a[i - 1 : i + 1] is the reverse of the last two characters of b.
        swap = (((~diagonal & match) << 1) & previous) & full
        diagonal = ((((match & up) + up) & full) ^ up) | match | down | swap
        rises = down | (full & ~(diagonal | up))
        falls = diagonal & up
        distance += bool(rises & last) - bool(falls & last)
        rises = ((rises << 1) | 1) & full
        falls = (falls << 1) & full
        up = falls | (full & ~(diagonal | rises))
        down = rises & diagonal
        previous = match
    return min(distance, limit + 1)


_NEG_PREFIXES = ("un", "in", "im", "il", "ir", "non", "dis", "anti", "de", "mis")
# Prefixes of opposite sense on a shared stem ("encrypt"/"decrypt", "inbound"/"outbound").
_PREFIX_PAIRS = frozenset(
    frozenset(p)
    for p in (
        ("en", "de"),
        ("in", "ex"),
        ("im", "ex"),
        ("in", "out"),
        ("up", "down"),
        ("over", "under"),
        ("pre", "post"),
        ("inter", "intra"),
        ("micro", "macro"),
        ("hyper", "hypo"),
        ("sub", "super"),
        ("max", "min"),
        ("inc", "dec"),
        ("im", "de"),
    )
)


def prefix_contrast(x: str, y: str) -> bool:
    """One word is the other with a negating prefix ("legal"/"illegal"), or the two put
    prefixes of opposite sense on one stem of four letters or more ("encrypt"/"decrypt")."""
    short, long_ = (x, y) if len(x) < len(y) else (y, x)
    if len(short) >= 3 and any(long_ == p + short for p in _NEG_PREFIXES):
        return True
    for cut_a in range(2, 6):
        for cut_b in range(2, 6):
            stem = x[cut_a:]
            if (
                len(stem) >= 4
                and stem == y[cut_b:]
                and frozenset((x[:cut_a], y[:cut_b])) in _PREFIX_PAIRS
            ):
                return True
    return False


# Suffixes that name other compounds on one stem: "sulfate" / "sulfite" / "sulfide",
# "nitrate" / "nitrite", "chlorate" / "chloride" (chemistry's anion endings).
_SUFFIX_SETS = (frozenset(("ate", "ite", "ide")),)


def suffix_contrast(x: str, y: str) -> bool:
    """The two words put different suffixes of one set (``_SUFFIX_SETS``) on one stem of four
    letters or more: "phosphate" / "phosphite"."""
    for suffixes in _SUFFIX_SETS:
        for sx in suffixes:
            for sy in suffixes - {sx}:
                stem = x[: -len(sx)]
                if x.endswith(sx) and y.endswith(sy) and len(stem) >= 4 and stem == y[: -len(sy)]:
                    return True
    return False
