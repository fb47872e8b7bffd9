"""Plurals that name another thing: a hard check beside the verifier.

The gate keys every word by its base form ("files" -> "file"), so a change of number is no
change: "What are the benefits of yoga?" is served "What is the benefit of yoga?"'s answer.
Two kinds of plural are not the singular's number but another term, and the gate refuses a
candidate whose only difference at a word is one of them:

* **A plural that modifies the next word.** English modifiers are singular ("a car dealer",
  "a book shop"); a noun that stays plural before the noun it modifies is a term of its own
  ("a savings account", "a customs broker", "securities law", "a goods train", "the arms
  trade"), not more than one of the singular ("a saving account", "a security trader"). So
  when one side has the plural and the other the singular right before the same content word
  (a noun, not an adjective or adverb), and nothing that agrees in number with a noun changed
  (an auxiliary "do"/"does", "is"/"are", a determiner "a"/"these", another inflected word),
  the number is that of a term, and the pair is refused. A plural subject or object changes
  with its agreement ("Why do birds eat seeds?" / "Why does a bird eat seeds?") and stays a
  paraphrase.
* **A name.** A word capitalised inside the text on both sides is a name, and a name does
  not inflect: "Microsoft Teams" / "Microsoft Team", "Google Sheets" / "Google Sheet", "Apple
  Pages" / "Page", "Mrs Smith" / "Mr Smith" are other products and people.

Left to the verifier: a plural with a meaning of its own as a head noun ("How do I clean
glasses?" / "... glass?", "How do I get into securities?"): WordNet lists some such plurals
as lemmas of their own, but as many ordinary plurals too ("words", "values", "names",
"ways", "terms", "effects"), so the lexicon cannot tell them apart and folding neither costs
more paraphrases than it saves. The check can only turn hits into misses.
"""

from __future__ import annotations

from cache.diff import PairDiff, align
from cache.lexicon import Lexicon
from cache.words import AUXILIARY, DETERMINER, Token

_AGREEING = AUXILIARY | DETERMINER


def number_changed(x: Token, y: Token, lex: Lexicon) -> bool:
    """Is one of the two words (aligned as one) the plural of the other?"""
    if x.norm == y.norm:
        return False
    short, long_ = (x.norm, y.norm) if len(x.norm) < len(y.norm) else (y.norm, x.norm)
    return long_.endswith("s") and short in lex.lemmas(long_)


def _name(x: Token, y: Token, lex: Lexicon) -> bool:
    """Two numbers of a word capitalised on both sides, used as a name: a common word
    (WordNet writes the singular in lower case: "Teams", "Sheets", "Pages") or a plural that
    is a word of its own ("Mrs"). Not a name: a possessive whose apostrophe one side left
    out ("Deans opponents" / "Dean's opponents"), and the plural of a word WordNet only
    writes with a capital ("Saturdays", "Americans", "Iraqis")."""
    if "'" in x.surface + y.surface or "\u2019" in x.surface + y.surface:
        return False
    short, long_ = (x.norm, y.norm) if len(x.norm) < len(y.norm) else (y.norm, x.norm)
    return short in lex.common or long_ in lex.synsets


def _noun(tok: Token, lex: Lexicon) -> bool:
    """A content word WordNet knows as a noun and never as an adjective or adverb."""
    if not tok.is_content or tok.is_number:
        return False
    forms = lex.forms(tok.norm)
    if not forms & lex.pos_lemmas.get("n", set()):
        return False
    return not ({tok.norm} & (lex.pos_lemmas.get("a", set()) | lex.pos_lemmas.get("r", set())))


def _agreement_changed(diff: PairDiff, lex: Lexicon, x: Token, y: Token) -> bool:
    """Did a word that agrees in number with a noun change, other than ``x``/``y``: an
    auxiliary or a determiner added, dropped or replaced, or another word inflected?"""
    changed = [*diff.deleted, *diff.inserted, *(t for pair in diff.substituted for t in pair)]
    if any(t.norm in _AGREEING for t in changed):
        return True
    return any(
        not (diff.a[i] is x and diff.b[j] is y) and _inflected(diff.a[i], diff.b[j], lex)
        for i, j in _aligned(diff)
    )


def _inflected(x: Token, y: Token, lex: Lexicon) -> bool:
    """Two forms of one word aligned as one ("eat"/"eats", "cat"/"cats"), not a typo."""
    if x.norm == y.norm:
        return False
    return x.norm in lex.forms(y.norm) or y.norm in lex.forms(x.norm)


def _aligned(diff: PairDiff) -> list[tuple[int, int]]:
    """(index in a, index in b) of the words aligned as one and of the words substituted
    ("savings" keys as "saving", "saving" as "save": two keys, one word in two numbers)."""
    index_a = {id(t): i for i, t in enumerate(diff.a)}
    index_b = {id(t): j for j, t in enumerate(diff.b)}
    subs = [(index_a[id(x)], index_b[id(y)]) for x, y in diff.substituted]
    return sorted([*diff.matched, *subs])


def term_changes(diff: PairDiff, lex: Lexicon) -> list[tuple[Token, Token]]:
    """Aligned words whose number changed where that number is a term's or a name's."""
    out: list[tuple[Token, Token]] = []
    matched = set(diff.matched)
    for i, j in _aligned(diff):
        x, y = diff.a[i], diff.b[j]
        if not number_changed(x, y, lex):
            continue
        if x.capitalised and y.capitalised:
            if _name(x, y, lex) and ((i - 1, j - 1) in matched or (i + 1, j + 1) in matched):
                out.append((x, y))
            continue
        if (i + 1, j + 1) not in matched or not _noun(diff.a[i + 1], lex):
            continue
        if not _agreement_changed(diff, lex, x, y):
            out.append((x, y))
    return out


def same_terms(a: str, b: str, lex: Lexicon | None = None) -> bool:
    """False when a plural changes to a singular (or back) where the plural is a term of its
    own (before the word it modifies) or a name (see the module's docstring)."""
    lexicon = lex or Lexicon.shared()
    return not term_changes(align(a, b, lexicon), lexicon)
