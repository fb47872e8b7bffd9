"""Align two requests word by word and describe what differs between them.

Near misses ("enable" -> "disable two-factor authentication", "from USD to CAD" -> "from CAD
to USD", "for adults" -> "for children") differ from their stored question in one to three
words; paraphrases either reword freely or change only the surface (case, contractions,
typos, a synonym, a moved clause). So the gate looks at the difference itself:

1. Tokens are normalised: lower case, contractions expanded ("don't" -> "do not"), number
   words turned into digits, and each word keyed by its WordNet base form ("files" -> "file",
   "succeeded" -> "succeed") so inflection is not a change.
2. Words present on one side only are matched again as typos (one or two edits between a
   dictionary word and a word that is not one and is not written like a name: two unknown
   words a letter apart, "argmax"/"argmin", "GitHub"/"GitLab", are two names) or as
   split/joined compounds ("setup"/"set up").
3. The keys are aligned (longest matching blocks, ``difflib``); words deleted in one place and
   inserted in another are moves, not changes; a replaced span pairs its words as
   substitutions.
4. The order of the words both sides share is read as blocks: a clause moved to the front is
   two blocks swapped; "X to Y" -> "Y to X" is a swap around a pivot word that stays between
   them (a role reversal), unless the pivot is "and"/"or" (a symmetric swap).

``PairDiff`` carries the result; ``cache.pairfeatures`` turns it into numbers.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from cache.lexicon import Lexicon
from cache.words import (
    DETERMINER,
    RELATION,
    SYMMETRIC_PIVOTS,
    Token,
    edit_distance,
    prefix_contrast,
    suffix_contrast,
    tokenize,
)


@dataclass
class PairDiff:
    a: list[Token]
    b: list[Token]
    deleted: list[Token] = field(default_factory=list)  # in a only
    inserted: list[Token] = field(default_factory=list)  # in b only
    substituted: list[tuple[Token, Token]] = field(default_factory=list)
    moved: list[Token] = field(default_factory=list)  # tokens of a found elsewhere in b
    typos: int = 0
    compounds: int = 0
    surface_changes: int = 0  # aligned words equal only after normalisation
    blocks: int = 1  # runs of shared words in the same relative order
    min_block: int = 0  # words in the shortest block (0: one block)
    moved_block_relation: bool = False  # a moved block starts with a preposition
    pivot_swaps: int = 0  # X p Y -> Y p X, p not symmetric
    symmetric_swaps: int = 0  # X and Y -> Y and X
    content_inversions: int = 0  # pairs of content words whose order flipped
    runs: int = 1  # runs of shared words that stay adjacent (a fronted clause: 2)
    matched: list[tuple[int, int]] = field(default_factory=list)  # (index in a, in b), same key


def _is_typo(x: Token, y: Token, lexicon: Lexicon) -> bool:
    """Is one word a misspelling of the other: one or two edits between a dictionary word and
    a word that is neither a dictionary word nor written like a name?"""
    a, b = x.norm, y.norm
    # Short words are too often distinct acronyms or units ("CSV"/"TSV", "TB"/"TiB").
    if not (a.isalpha() and b.isalpha()) or min(len(a), len(b)) < 4:
        return False
    known_a, known_b = lexicon.known(a), lexicon.known(b)
    if known_a and known_b:
        return False  # two real words: a substitution, never a typo
    if not (known_a or known_b):
        return False  # two names a letter apart: "argmax"/"argmin", "Novolog"/"Novolin"
    unknown = y if known_a else x
    if _named(unknown):
        return False  # "Pydantic" against "pedantic": a name, not a misspelt word
    if unknown.position == 0 and unknown.surface[:1].isupper() and sorted(a) != sorted(b):
        # The text's first word: its capital says nothing, a name looks like a misspelt word
        # ("Gradle builds" / "Grade builds"); only two letters swapped ("Tranlsate") read as
        # a typo there.
        return False
    if prefix_contrast(a, b) or suffix_contrast(a, b):
        return False  # "subscribe" / "unsubscribe", "sulfate" / "sulfite": another word
    if a[0] != b[0] and a[:2] != b[1::-1]:
        # A misspelling keeps the first letter (or swaps the first two: "hte"); another first
        # letter is another word: "react" / "preact", "dexamethasone" / "betamethasone".
        return False
    limit = 1 if min(len(a), len(b)) < 6 else 2
    return edit_distance(a, b, limit) <= limit


def _named(tok: Token) -> bool:
    """Written like a name or an identifier: a capital inside the text or inside the word."""
    return tok.capitalised or any(c.isupper() for c in tok.surface[1:])


# Pairs of words weighed as a possible typo (a dictionary look-up or two each): a question
# lacks a few words of the other on each side, a few dozen pairs; two long texts that lack
# hundreds are no typo apart, and past the bound their other words stay as written (the
# search would grow with the product of the two counts, on the cache's one search thread).
MAX_TYPO_TRIALS = 4096


def _rekey(a: list[Token], b: list[Token], lexicon: Lexicon, diff: PairDiff) -> list[Token]:
    """Give b's typos and split/joined compounds the keys of their counterparts in a."""
    keys_a = {t.key for t in a}
    keys_b = {t.key for t in b}
    only_a = [t for t in a if t.key not in keys_b and t.is_content]
    by_norm: dict[str, list[Token]] = {}  # only_a's words by spelling, in order
    for t in only_a:
        by_norm.setdefault(t.norm, []).append(t)
    misspellable = [t for t in only_a if _spelt_out(t)]
    pairs = _neighbour_pairs(a)
    trials = 0
    out = list(b)
    i = 0
    while i < len(out):
        tok = out[i]
        if tok.key in keys_a:
            i += 1
            continue
        if i + 1 < len(out):
            joined = by_norm.get(tok.norm + out[i + 1].norm)
            if joined:
                partner = joined[0]
                out[i] = Token(tok.surface, tok.norm, partner.key, tok.position, tok.capitalised)
                out.pop(i + 1)
                diff.compounds += 1
                i += 1
                continue
        j = pairs.get(tok.norm)
        if j is not None:
            out[i : i + 1] = [
                Token(tok.surface, a[j].norm, a[j].key, tok.position, tok.capitalised),
                Token(tok.surface, a[j + 1].norm, a[j + 1].key, tok.position, tok.capitalised),
            ]
            diff.compounds += 1
            i += 2
            continue
        if tok.is_content and _spelt_out(tok) and trials < MAX_TYPO_TRIALS:
            misspelt: Token | None = None
            for t in misspellable[: MAX_TYPO_TRIALS - trials]:
                trials += 1
                if _is_typo(t, tok, lexicon):
                    misspelt = t
                    break
            if misspelt is not None:
                out[i] = Token(tok.surface, tok.norm, misspelt.key, tok.position, tok.capitalised)
                misspellable.remove(misspelt)
                by_norm[misspelt.norm].remove(misspelt)
                diff.typos += 1
        i += 1
    return out


def _spelt_out(tok: Token) -> bool:
    """A word ``_is_typo`` may weigh: letters only, four or more, not an acronym."""
    return tok.norm.isalpha() and len(tok.norm) >= 4 and not tok.surface.isupper()


def _neighbour_pairs(a: list[Token]) -> dict[str, int]:
    """Each two neighbouring words of ``a`` written as one ("set" "up": "setup"), to where the
    first such pair starts: a word of b that splits into them."""
    out: dict[str, int] = {}
    for j in range(len(a) - 1):
        if a[j].norm and a[j + 1].norm:
            out.setdefault(a[j].norm + a[j + 1].norm, j)
    return out


# Inverted pairs of shared content words examined (each for a pivot between it): a paraphrase
# moves a clause or two, a few dozen pairs; past this the pair is a reshuffle, the feature is
# saturated, and the examination (linear in the text per pair) would grow with the cube of it.
MAX_INVERSIONS = 256


# Texts whose tokens are remembered: questions, which recur (a stored one is compared with
# every near query). The memory is bounded by both: 4,096 texts of at most 512 characters (a
# longer text is tokenized again when compared: milliseconds, and it is rarely compared).
_REMEMBERED = 4096
_REMEMBERED_CHARS = 512


@lru_cache(maxsize=_REMEMBERED)
def _shared_tokens(text: str) -> tuple[Token, ...]:
    return tuple(tokenize(text, Lexicon.shared()))


def prepare(text: str) -> None:
    """Tokenize a stored text ahead of its first comparison (remembered, as in ``_tokens``)."""
    if len(text) <= _REMEMBERED_CHARS:
        _shared_tokens(text)


def _tokens(text: str, lexicon: Lexicon) -> list[Token]:
    """Tokens of a text; with the process's lexicon and a short text, remembered."""
    if lexicon is Lexicon.shared() and len(text) <= _REMEMBERED_CHARS:
        return list(_shared_tokens(text))
    return tokenize(text, lexicon)


# Pairs of equal words difflib may weigh (the sum over words of their counts on each side
# multiplied): 4,000 characters of English prose weigh about 6,000; "a b c " * 150 weighs 45,000.
MAX_ALIGN_WORK = 40_000


def _align_work(ka: list[str], kb: list[str]) -> int:
    counts = Counter(ka)
    return sum(counts[k] for k in kb)


def align(stored: str, query: str, lexicon: Lexicon) -> PairDiff:
    a = _tokens(stored, lexicon)
    b0 = _tokens(query, lexicon)
    diff = PairDiff(a, b0)
    b = _rekey(a, b0, lexicon, diff)
    diff.b = b
    ka, kb = [t.key for t in a], [t.key for t in b]
    deleted: list[Token] = []
    inserted: list[Token] = []
    replaced: list[tuple[list[Token], list[Token]]] = []
    pairs: list[tuple[int, int]] = []  # (index in a, index in b) of the same word
    # difflib's matching costs about the pairs of equal words it must weigh, and more on
    # repetitive text ("a b c " * 600: seconds, on the cache's one search thread): past the
    # bound no run is aligned, every shared word reads as moved, and the pair is refused.
    opcodes = (
        difflib.SequenceMatcher(None, ka, kb, autojunk=False).get_opcodes()
        if _align_work(ka, kb) <= MAX_ALIGN_WORK
        else [("replace", 0, len(a), 0, len(b))]
    )
    for op, i1, i2, j1, j2 in opcodes:
        if op == "equal":
            pairs.extend(zip(range(i1, i2), range(j1, j2), strict=True))
            diff.surface_changes += sum(
                a[i].norm != b[j].norm for i, j in zip(range(i1, i2), range(j1, j2), strict=True)
            )
        elif op == "delete":
            deleted.extend(a[i1:i2])
        elif op == "insert":
            inserted.extend(b[j1:j2])
        else:
            replaced.append((a[i1:i2], b[j1:j2]))
    # Moves: a word deleted here and inserted there is the same word, displaced.
    for span_a, span_b in replaced:
        deleted.extend(span_a)
        inserted.extend(span_b)
    index_a = {id(t): i for i, t in enumerate(a)}
    index_b = {id(t): j for j, t in enumerate(b)}
    pool: dict[str, list[Token]] = {}
    for t in inserted:
        pool.setdefault(t.key, []).append(t)
    kept_deleted: list[Token] = []
    for t in deleted:
        twins = pool.get(t.key)
        if twins:
            twin = twins.pop(0)
            pairs.append((index_a[id(t)], index_b[id(twin)]))
            diff.moved.append(t)
        else:
            kept_deleted.append(t)
    moved_keys = [t.key for t in diff.moved]
    kept_inserted: list[Token] = []
    for t in inserted:
        if t.key in moved_keys:
            moved_keys.remove(t.key)
        else:
            kept_inserted.append(t)
    diff.deleted, diff.inserted = _pair_substitutions(kept_deleted, kept_inserted, diff)
    diff.matched = sorted(pairs)
    _order(diff, diff.matched)
    return diff


def _pair_substitutions(
    deleted: list[Token], inserted: list[Token], diff: PairDiff
) -> tuple[list[Token], list[Token]]:
    """Pair leftover words of a with those of b in reading order, like with like."""
    rest_a: list[Token] = []
    pending = list(inserted)
    for t in deleted:
        partner = next(
            (u for u in pending if u.is_content == t.is_content and u.is_number == t.is_number),
            None,
        )
        if partner is None:
            rest_a.append(t)
        else:
            pending.remove(partner)
            diff.substituted.append((t, partner))
    return rest_a, pending


def _order(diff: PairDiff, pos_in_b: list[tuple[int, int]]) -> None:
    """Blocks, swaps and inversions of the words both sides share (aligned or moved)."""
    if len(pos_in_b) < 2:
        return
    seq = [j for _, j in pos_in_b]
    rank = {j: r for r, j in enumerate(sorted(seq))}
    ranks = [rank[j] for j in seq]
    diff.runs = 1 + sum(1 for k in range(1, len(ranks)) if ranks[k] != ranks[k - 1] + 1)
    runs: list[list[int]] = [[0]]
    for k in range(1, len(seq)):
        if seq[k] > seq[k - 1]:
            runs[-1].append(k)
        else:
            runs.append([k])
    diff.blocks = len(runs)
    if len(runs) > 1:
        diff.min_block = min(len(r) for r in runs)
        for run in runs[1:]:
            first = diff.a[pos_in_b[run[0]][0]]
            if first.norm in RELATION:
                diff.moved_block_relation = True
        first_run = diff.a[pos_in_b[runs[0][0]][0]]
        if first_run.norm in RELATION and len(runs) == 2:
            diff.moved_block_relation = True
    content = [(i, j) for i, j in pos_in_b if diff.a[i].is_content]
    fronting = diff.runs == 2  # one clause moved to the other end: no pivot can lie between
    # Where in b the content words after each one reach lowest: a word with none before it in
    # b starts no inversion and is passed in one step (two texts in the same order would
    # otherwise weigh all n^2 / 2 pairs); each other word adds one at least, to the bound.
    lowest_after = [len(diff.b)] * len(content)
    for x in range(len(content) - 2, -1, -1):
        lowest_after[x] = min(lowest_after[x + 1], content[x + 1][1])
    for x in range(len(content)):
        if diff.content_inversions >= MAX_INVERSIONS:
            break  # far from any paraphrase already: the counts saturate, the cost stays bounded
        if lowest_after[x] >= content[x][1]:
            continue
        for y in range(x + 1, len(content)):
            (ia, ja), (ib, jb) = content[x], content[y]
            if ja <= jb:
                continue
            diff.content_inversions += 1
            if diff.content_inversions > MAX_INVERSIONS:
                break
            between_a = {k for k, _ in pos_in_b if ia < k < ib}
            between_b = {i for i, j in pos_in_b if jb < j < ja}
            pivots = between_a & between_b
            if not pivots or fronting:
                continue
            words = {diff.a[k].norm for k in pivots}
            if words & SYMMETRIC_PIVOTS and all(
                w in SYMMETRIC_PIVOTS or w in DETERMINER for w in words
            ):
                diff.symmetric_swaps += 1
            else:
                diff.pivot_swaps += 1
