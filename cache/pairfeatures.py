"""Numbers the gate's model reads for one (stored question, new question) pair.

Built on ``cache.diff.align``: every feature describes the difference between the two texts
(what kind of word changed and how it relates to its replacement) or the similarity of the
rest, never a particular word. A substituted pair of words is judged with WordNet
(``cache.lexicon``): same synset (synonym), a near sense (similar-to, verb group, also-see),
one a kind of the other (hypernym within two steps), siblings (a shared parent: "apple" /
"banana", "Norway" / "Sweden"), opposites (antonyms, also through similar senses, and
negating prefixes: "legal" / "illegal"), derivations, and the classes of the changed words
(units, persons, times, languages, places, organisations, quantities). Closed grammatical
classes (negation, relation words, quantifiers, modals, wh-words, pronouns) are counted as
such, numbers are compared as values, and word order is read as blocks and swaps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from cache.diff import PairDiff, align
from cache.lexicon import Lexicon
from cache.surface import SURFACE_NAMES, surface_features
from cache.words import (
    AUXILIARY,
    DISCOURSE,
    MODAL,
    NEGATION,
    PRONOUN,
    QUANTIFIER,
    RELATION,
    WH,
    Token,
    edit_distance,
    prefix_contrast,
)

CLASSES = ("unit", "person", "time", "language", "place", "organization", "quantity")
_VALUE_CLASSES = frozenset(("unit", "person", "time", "language", "place"))

RELATIONS = (
    "synonym",
    "synonym_minor",
    "near",
    "hyper",
    "derived",
    "sibling",
    "value",
    "antonym",
    "attribute",
    "unknown",
    "unrelated",
)

FEATURE_NAMES: tuple[str, ...] = (
    "cosine",
    "len_a",
    "len_b",
    "content_a",
    "content_b",
    "key_jaccard",
    "content_jaccard",
    "shared_ratio",
    "deleted_content",
    "inserted_content",
    "deleted_function",
    "inserted_function",
    "changed_content",
    "changed_total",
    "typos",
    "compounds",
    "surface_changes",
    *(f"sub_{r}" for r in RELATIONS),
    "sub_count",
    "sub_char_sim_max",
    *(f"changed_{c}" for c in CLASSES),
    "changed_capitalised",
    "changed_unknown",
    "number_changed",
    "number_substituted",
    "numbers_total",
    "negation_flip",
    "negation_changed",
    "relation_changed",
    "quantifier_changed",
    "modal_changed",
    "wh_changed",
    "pronoun_changed",
    "comparative_changed",
    "discourse_changed",
    "frame_changed",
    "blocks",
    "min_block",
    "moved_content",
    "moved_block_relation",
    "pivot_swaps",
    "symmetric_swaps",
    "content_inversions",
    "runs",
    "ins_modifier",
    "char3_jaccard",
    "max_changed_run",
    *(f"surface_{n}" for n in SURFACE_NAMES),
)


def relation(x: Token, y: Token, lex: Lexicon) -> str:
    """How word ``y`` relates to the word ``x`` it replaced."""
    a, b = x.norm, y.norm
    if prefix_contrast(a, b):
        return "antonym"
    fa, fb = _forms(x, lex), _forms(y, lex)
    for f in fa:
        if lex.antonyms.get(f, frozenset()) & fb:
            return "antonym"
    sa = {s for f in fa for s in lex.synsets.get(f, ())}
    sb = {s for f in fb for s in lex.synsets.get(f, ())}
    if not sa or not sb:
        return "unknown"
    # A shared sense among the two most frequent of each word: "buy"/"purchase". A shared
    # rare sense ("second"/"minute" as "a moment") is weaker evidence.
    # Two values of one measure or kind of thing ("seconds"/"minutes", "adults"/"children",
    # "French"/"German") are different questions even where WordNet shares a loose sense.
    if lex.classes(a) & lex.classes(b) & _VALUE_CLASSES and not (fa & fb):
        return "value"
    da = {s for f in fa for s in lex.dominant(f)}
    db = {s for f in fb for s in lex.dominant(f)}
    if da & db:
        return "synonym"
    shared_minor = bool(sa & sb)
    near_a = {n for s in sa for n in lex.near.get(s, ())}
    near_b = {n for s in sb for n in lex.near.get(s, ())}
    if _indirect_antonym(fa, sb, lex) or _indirect_antonym(fb, sa, lex):
        return "antonym"
    if near_a & sb or near_b & sa or near_a & near_b:
        return "near"
    if shared_minor:
        return "synonym_minor"
    for f in fa:
        if lex.derived.get(f, frozenset()) & fb:
            return "derived"
    up_a = _up(sa, lex, 2)
    up_b = _up(sb, lex, 2)
    if up_a & sb or up_b & sa:
        return "hyper"
    attrs_a = {t for s in sa for t in lex.attributes.get(s, ())}
    attrs_b = {t for s in sb for t in lex.attributes.get(s, ())}
    if attrs_a & attrs_b:
        return "attribute"
    if _up(sa, lex, 1) & _up(sb, lex, 1):
        return "sibling"
    if up_a & up_b:
        return "sibling"
    return "unrelated"


def _forms(tok: Token, lex: Lexicon) -> set[str]:
    """The word, its noun/verb base forms and, for "-er"/"-est", the adjective it grades.

    An acronym ("HTTPS", "CDS", "ADS": all capitals) has no inflections: its final "S" is a
    letter of it, not a plural ("HTTPS" is not more than one "HTTP"), as in its key."""
    word = tok.norm
    if _acronym(tok):
        return {word}
    out = lex.forms(word)
    base = _adjective_base(word, lex)
    if base:
        out.add(base)
    return out


def _acronym(tok: Token) -> bool:
    return len(tok.surface) > 1 and tok.surface.isalpha() and tok.surface.isupper()


def _adjective_base(word: str, lex: Lexicon) -> str | None:
    exc = lex.exceptions.get("a", {}).get(word)
    if exc:
        return exc
    adj = lex.pos_lemmas.get("a", set())
    for suffix in ("er", "est"):
        if word.endswith(suffix) and len(word) > len(suffix) + 2:
            stem = word[: -len(suffix)]
            for base in (stem, stem + "e", stem[:-1] + "y" if stem.endswith("i") else ""):
                if base in adj:
                    return base
            if stem[-1] == stem[-2] and stem[:-1] in adj:
                return stem[:-1]
    return None


def _indirect_antonym(forms: set[str], senses_other: set[int], lex: Lexicon) -> bool:
    """An antonym of ``forms`` whose sense is near (similar-to) a sense of the other word."""
    for f in forms:
        for ant in lex.antonyms.get(f, frozenset()):
            for s in lex.senses(ant):
                if s in senses_other or senses_other & set(lex.near.get(s, ())):
                    return True
    return False


def _up(senses: Iterable[int], lex: Lexicon, depth: int) -> set[int]:
    out: set[int] = set()
    frontier = set(senses)
    for _ in range(depth):
        frontier = {h for s in frontier for h in lex.hypernyms.get(s, ())}
        out |= frontier
    return out


def _comparative(word: str, lex: Lexicon) -> bool:
    if word in ("more", "less", "fewer", "most", "least"):
        return True
    return _adjective_base(word, lex) is not None


def _char_sim(a: str, b: str) -> float:
    longest = max(len(a), len(b))
    if not longest:
        return 1.0
    return 1.0 - min(edit_distance(a, b, longest), longest) / longest


def _changed_words(diff: PairDiff) -> list[Token]:
    out = list(diff.deleted) + list(diff.inserted)
    for x, y in diff.substituted:
        out.extend((x, y))
    return out


def _numbers(tokens: Sequence[Token]) -> list[str]:
    return sorted(t.norm for t in tokens if t.is_number)


def features_of(diff: PairDiff, cosine: float, lex: Lexicon) -> list[float]:
    a, b = diff.a, diff.b
    ka, kb = {t.key for t in a}, {t.key for t in b}
    ca = {t.key for t in a if t.is_content}
    cb = {t.key for t in b if t.is_content}
    shared = len(a) - len(diff.deleted) - len(diff.substituted)
    relations = dict.fromkeys(RELATIONS, 0)
    char_sim = 0.0
    for x, y in diff.substituted:
        if x.is_content and not x.is_number:
            relations[relation(x, y, lex)] += 1
            char_sim = max(char_sim, _char_sim(x.norm, y.norm))
    changed = _changed_words(diff)
    classes = dict.fromkeys(CLASSES, 0)
    for t in changed:
        if t.is_content and not t.is_number:
            for c in lex.classes(t.norm):
                classes[c] += 1
    na, nb = _numbers(a), _numbers(b)
    neg_a = sum(t.norm in NEGATION for t in a)
    neg_b = sum(t.norm in NEGATION for t in b)
    neg_changed = sum(t.norm in NEGATION for t in changed)

    frame = _frame_words(diff)

    def count(words: frozenset[str]) -> float:
        return float(sum(t.norm in words and id(t) not in frame for t in changed))

    number_sub = sum(x.is_number and y.is_number for x, y in diff.substituted)
    ins_modifier = _inserted_modifiers(diff)
    return [
        cosine,
        float(len(a)),
        float(len(b)),
        float(len(ca)),
        float(len(cb)),
        len(ka & kb) / max(len(ka | kb), 1),
        len(ca & cb) / max(len(ca | cb), 1),
        shared / max(len(a), len(b), 1),
        float(sum(t.is_content for t in diff.deleted)),
        float(sum(t.is_content for t in diff.inserted)),
        float(sum(t.is_function for t in diff.deleted)),
        float(sum(t.is_function for t in diff.inserted)),
        float(sum(t.is_content for t in changed)),
        float(len(changed)),
        float(diff.typos),
        float(diff.compounds),
        float(diff.surface_changes),
        *(float(relations[r]) for r in RELATIONS),
        float(len(diff.substituted)),
        char_sim,
        *(float(classes[c]) for c in CLASSES),
        float(sum(t.capitalised for t in changed)),
        float(sum(t.is_content and not t.is_number and not lex.known(t.norm) for t in changed)),
        float(na != nb),
        float(number_sub),
        float(len(na) + len(nb)),
        float(neg_a % 2 != neg_b % 2),
        float(neg_changed),
        count(RELATION),
        count(QUANTIFIER),
        count(MODAL),
        count(WH),
        count(PRONOUN),
        float(sum(_comparative(t.norm, lex) for t in changed)),
        float(sum(t.norm in DISCOURSE for t in changed)),
        float(len(frame)),
        float(diff.blocks),
        float(diff.min_block),
        float(sum(t.is_content for t in diff.moved)),
        float(diff.moved_block_relation),
        float(diff.pivot_swaps),
        float(diff.symmetric_swaps),
        float(diff.content_inversions),
        float(diff.runs),
        float(ins_modifier),
        _char3(a, b),
        float(_max_changed_run(diff)),
    ]


def _char3(a: Sequence[Token], b: Sequence[Token]) -> float:
    ga, gb = _grams(" ".join(t.norm for t in a)), _grams(" ".join(t.norm for t in b))
    return len(ga & gb) / max(len(ga | gb), 1)


def _grams(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(max(len(text) - 2, 1))}


def _max_changed_run(diff: PairDiff) -> int:
    """Longest run of consecutive words of either side that the other side lacks (an added
    clause: "... until elections are held")."""
    best = 0
    for tokens, extra in ((diff.a, diff.deleted), (diff.b, diff.inserted)):
        changed = {id(t) for t in extra} | {id(t) for pair in diff.substituted for t in pair}
        run = 0
        for t in tokens:
            run = run + 1 if id(t) in changed else 0
            best = max(best, run)
    return best


def _frame_words(diff: PairDiff) -> set[int]:
    """Changed auxiliaries and modals right after a wh-word ("how do I" / "how can I" / "how
    should I"): the frame of a question, not its content. Ids of those tokens."""
    changed = {id(t) for t in diff.deleted} | {id(t) for t in diff.inserted}
    changed |= {id(t) for pair in diff.substituted for t in pair}
    out: set[int] = set()
    for tokens in (diff.a, diff.b):
        for prev, tok in pairwise(tokens):
            if id(tok) in changed and prev.norm in WH and tok.norm in AUXILIARY | MODAL:
                out.add(id(tok))
    return out


def _inserted_modifiers(diff: PairDiff) -> int:
    """Content words inserted right before a shared content word (a new restriction:
    "a file" -> "every .txt file")."""
    shared = {t.key for t in diff.a} & {t.key for t in diff.b}
    count = 0
    for tokens, extra in ((diff.b, diff.inserted), (diff.a, diff.deleted)):
        ids = {id(t) for t in extra}
        for i, t in enumerate(tokens[:-1]):
            nxt = tokens[i + 1]
            if id(t) in ids and t.is_content and nxt.is_content and nxt.key in shared:
                count += 1
    return count


def pair_features(
    stored: str, query: str, cosine: float, lex: Lexicon | None = None
) -> list[float]:
    lexicon = lex or Lexicon.shared()
    return features_of(align(stored, query, lexicon), cosine, lexicon) + surface_features(
        stored, query
    )


def feature_matrix(
    stored: Sequence[str],
    queries: Sequence[str],
    cosines: Sequence[float],
    lex: Lexicon | None = None,
) -> npt.NDArray[np.float64]:
    lexicon = lex or Lexicon.shared()
    rows = [
        pair_features(a, b, float(c), lexicon)
        for a, b, c in zip(stored, queries, cosines, strict=True)
    ]
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_NAMES))
