"""Letter case: a hard check beside the verifier, whose words and embedder are lower case.

MiniLM is uncased and ``cache.words`` lower-cases every token, so "What is the molar mass of
CO?" and "... of Co?" (carbon monoxide, cobalt) are one text to both (cosine 1.0), and so are
"MB"/"Mb", "mg"/"Mg", "mW"/"MW", "US policy"/"us policy", "Turkey"/"turkey",
``getUserName``/``getUsername``. Case is what tells acronyms, units, chemical symbols, proper
names and identifiers apart, so the gate (``cache.gate``) refuses a candidate where a word
both texts contain is written with other capitals, after the verifier accepted it.

Words are runs of letters and digits. Each text's words are grouped by their lower-case form;
the pair is refused when a lower-case form has spellings on both sides and none in common
("CO" / "Co"; "Set and set" / "set and Set" share both). Spellings that say nothing about
the word, and are left out so that paraphrase hits stay hits:

* a word at the start of the text or of a sentence (after ``.``, ``!``, ``?``, ``:``, ``;``,
  a line break or an opening quote) unless it has capitals after its first letter, and
  there an all-capitals word of three letters or more too (a headline's "WALL St", "THE
  government"); "CO levels" at the start stays "CO";
* a capitalised word of four letters or more next to another capitalised word: part of a
  multi-word name ("State Department", "Supreme Court"), which paraphrases often write in
  lower case ("the state's supreme court"); alone ("the population of Turkey") it counts;
* the pronoun "I";
* a whole text typed in one case ("WHAT IS THE CAPITAL OF FRANCE?", "what is the capital of
  france?"): a text with no upper-case letter, or none in lower case, says nothing about
  case, and the check passes.

Words only one side has are the verifier's to read. The check can only turn hits into misses;
a user who capitalises a common word mid-sentence ("How do I use Python?" / "how do I use
python?") misses a paraphrase, which the cache accepts rather than serve "Polish" for
"polish".
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

_WORD = re.compile(r"[^\W_]+")
_BREAKS = frozenset(".!?:;\n\"'`\u201c\u2018")


def _marked(word: str) -> bool:
    """Capitals after the first letter: an acronym, a unit, an identifier ("CO", "mW")."""
    return any(c.isupper() for c in word[1:])


def _capitalised(word: str) -> bool:
    return word[:1].isupper()


Spelling = frozenset[str] | None  # the spellings an occurrence allows; None: any


@lru_cache(maxsize=1024)  # a stored text is compared with every question near it
def spellings(text: str) -> dict[str, tuple[Spelling, ...]] | None:
    """Per lower-case word, what each occurrence says about its case (see the module's
    docstring); None when the text is written in one case only."""
    if text == text.lower() or text == text.upper():
        return None
    matches = list(_WORD.finditer(text))
    found: dict[str, list[Spelling]] = {}
    for i, match in enumerate(matches):
        word = match.group(0)
        found.setdefault(word.lower(), []).append(_spelling(text, matches, i))
    return {lower: tuple(occurrences) for lower, occurrences in found.items()}


def _spelling(text: str, matches: list[re.Match[str]], i: int) -> Spelling:
    word = matches[i].group(0)
    lower = word.lower()
    if lower == "i":
        return None
    if _starts_sentence(text, matches[i].start()):
        if word.isupper() and len(word) >= 3:
            return None  # a headline's capitals
        return frozenset((word, lower)) if not _marked(word) else frozenset((word,))
    if _capitalised(word) and not _marked(word) and len(word) >= 4:
        before = matches[i - 1].group(0) if i > 0 else ""
        after = matches[i + 1].group(0) if i + 1 < len(matches) else ""
        if _capitalised(before) or _capitalised(after):
            return None  # part of a multi-word name
    return frozenset((word,))


def _starts_sentence(text: str, start: int) -> bool:
    i = start - 1
    while i >= 0 and text[i].isspace() and text[i] != "\n":
        i -= 1
    return i < 0 or text[i] in _BREAKS


def _differ(a: tuple[Spelling, ...], b: tuple[Spelling, ...]) -> bool:
    """No spelling in common; or, as many occurrences each, all of one spelling, and not the
    same ones ("mW and MW" / "mW and mw")."""
    allowed_a = frozenset().union(*(s for s in a if s is not None))
    allowed_b = frozenset().union(*(s for s in b if s is not None))
    if allowed_a and allowed_b and not allowed_a & allowed_b:
        return True
    single_a = Counter(next(iter(s)) for s in a if s is not None and len(s) == 1)
    single_b = Counter(next(iter(s)) for s in b if s is not None and len(s) == 1)
    definite = single_a.total() == len(a) == len(b) == single_b.total()
    return definite and single_a != single_b


def same_case(a: str, b: str) -> bool:
    """True unless a word both texts contain is capitalised differently (see the module's
    docstring); the gate refuses a candidate otherwise."""
    forms_a, forms_b = spellings(a), spellings(b)
    if forms_a is None or forms_b is None:
        return True
    return not any(_differ(forms, forms_b[w]) for w, forms in forms_a.items() if w in forms_b)
