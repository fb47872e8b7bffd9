"""Labelled training pairs made from real questions by perturbing them.

Every seed question yields pairs of both labels; the perturbations are general edits of
English, not fitted to any evaluation file:

label 0 (the answer changes): negation added or removed; a word replaced by a WordNet
antonym; a noun replaced by a sibling (another kind of the same parent: "apple" -> "pear",
"Norway" -> "Denmark", "miles" -> "yards"); a number changed; two content words swapped
around a non-symmetric pivot ("from X to Y" -> "from Y to X"); a relation word flipped
("before" -> "after", "to" -> "from"); a quantifier changed ("all" -> "one"); a comparative
flipped ("more" -> "less"); a wh-word changed ("why" -> "how"); a restricting word inserted
before a noun; a capitalised name replaced by another name seen in the corpus.

label 1 (the same question): a word replaced by another lemma of its most frequent synset;
contractions expanded or made; one or two typos; lower case without the question mark;
a trailing clause fronted ("X in Y?" -> "In Y, X?"); "X and Y" -> "Y and X"; "how do I" ->
"how can I"; a politeness frame added.

``source`` of each pair names the perturbation, so training can balance and report them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cache.lexicon import Lexicon, wordnet_dir
from cache.training.perturb_words import (
    AUX,
    COMPARATIVES,
    CONTRACT,
    MODIFIERS,
    POLITE,
    QUANTIFIERS,
    SWAP_RELATIONS,
    WH_SWAPS,
)
from cache.words import FUNCTION, WH

_PIECE = re.compile(r"^(\W*)(.*?)(\W*)$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Generated:
    source: str
    label: int
    text_a: str
    text_b: str


class SenseOrder:
    """Most frequent synset first, from WordNet's ``index.*`` files (offline only)."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = directory or wordnet_dir()
        self.first: dict[tuple[str, str], int] = {}
        pos_index = {"noun": (0, "n"), "verb": (1, "v"), "adj": (2, "a"), "adv": (3, "r")}
        for name, (idx, pos) in pos_index.items():
            with open(directory / f"index.{name}", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith(" "):
                        continue
                    parts = line.split()
                    lemma, synset_cnt = parts[0], int(parts[2])
                    offsets = parts[-synset_cnt:]
                    self.first[(lemma.replace("_", " "), pos)] = int(offsets[0]) * 4 + idx


def _words(text: str) -> list[tuple[str, str, str]]:
    out = []
    for piece in text.split():
        m = _PIECE.match(piece)
        assert m is not None
        out.append((m.group(1), m.group(2), m.group(3)))
    return out


def _join(words: Sequence[tuple[str, str, str]]) -> str:
    return " ".join(p + c + s for p, c, s in words if p + c + s)


def _match_case(new: str, old: str) -> str:
    if old[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


class Perturber:
    def __init__(self, lexicon: Lexicon, senses: SenseOrder, names: Sequence[str], seed: int):
        self.lex = lexicon
        self.senses = senses
        self.names = list(names)
        self.rng = random.Random(seed)
        self._members: dict[int, list[str]] = {}
        self._children: dict[int, list[int]] = {}
        for word, sids in lexicon.synsets.items():
            if " " in word or "-" in word:
                continue
            for sid in sids:
                self._members.setdefault(sid, []).append(word)
        for sid, parents in lexicon.hypernyms.items():
            for parent in parents:
                self._children.setdefault(parent, []).append(sid)

    # -- helpers ------------------------------------------------------------------------
    def _replace_one(
        self, text: str, choose: Callable[[str], str | None], source: str, label: int
    ) -> Generated | None:
        words = _words(text)
        order = list(range(len(words)))
        self.rng.shuffle(order)
        for i in order:
            pre, core, post = words[i]
            if not core:
                continue
            new = choose(core)
            if new and new.lower() != core.lower():
                words[i] = (pre, _match_case(new, core), post)
                return Generated(source, label, text, _join(words))
        return None

    def _common(self, word: str) -> bool:
        return (
            word.isalpha()
            and 4 <= len(word) <= 12
            and word in self.lex.synsets
            and word not in FUNCTION
        )

    def _noun(self, word: str) -> bool:
        """A word whose senses are mostly nouns (so swapping it keeps the grammar)."""
        sids = self.lex.synsets.get(word, ())
        return bool(sids) and sum(s % 4 == 0 for s in sids) * 2 > len(sids)

    # -- label 0 ------------------------------------------------------------------------
    def negate(self, text: str) -> Generated | None:
        words = _words(text)
        for i, (pre, core, post) in enumerate(words):
            low = core.lower()
            if low in ("not", "no", "never"):
                return Generated("gen_negation", 0, text, _join(words[:i] + words[i + 1 :]))
            if low.endswith("n't") and low not in ("can't", "won't"):
                words[i] = (pre, core[:-3], post)
                return Generated("gen_negation", 0, text, _join(words))
        for i, (_, core, _) in enumerate(words):
            # Not the first word: "Can not you explain" is no question anyone asks.
            prev = words[i - 1] if i > 0 else ("", "", ".")
            declarative = prev[1] and prev[1].lower() not in WH and not prev[2]
            if declarative and core.lower() in AUX and i + 1 < len(words):
                words.insert(i + 1, ("", "not", ""))
                return Generated("gen_negation", 0, text, _join(words))
        return None

    def antonym(self, text: str) -> Generated | None:
        def pick(core: str) -> str | None:
            ants = sorted(a for a in self.lex.antonyms.get(core.lower(), ()) if " " not in a)
            return self.rng.choice(ants) if ants else None

        return self._replace_one(text, pick, "gen_antonym", 0)

    def sibling(self, text: str) -> Generated | None:
        def pick(core: str) -> str | None:
            low = core.lower()
            if not self._common(low) or not self._noun(low):
                return None
            sid = self.senses.first.get((low, "n"))
            if sid is None:
                return None
            options: list[str] = []
            for parent in self.lex.hypernyms.get(sid, ()):
                for child in self._children.get(parent, ()):
                    if child != sid:
                        options.extend(w for w in self._members.get(child, ()) if w != low)
            options = [w for w in options if 3 <= len(w) <= 12]
            return self.rng.choice(sorted(options)) if options else None

        return self._replace_one(text, pick, "gen_sibling", 0)

    def number(self, text: str) -> Generated | None:
        def pick(core: str) -> str | None:
            if not core.isdigit():
                return None
            value = int(core)
            return str(value + self.rng.choice([-2, -1, 1, 2, 5, 10]) if value > 10 else value + 1)

        return self._replace_one(text, pick, "gen_number", 0)

    def closed_class(self, text: str) -> Generated | None:
        table = {**SWAP_RELATIONS, **QUANTIFIERS, **COMPARATIVES, **WH_SWAPS}

        def pick(core: str) -> str | None:
            return table.get(core.lower())

        return self._replace_one(text, pick, "gen_closed_class", 0)

    def swap(self, text: str) -> Generated | None:
        """Two content words around a pivot trade places (symmetric pivots give label 1)."""
        words = _words(text)

        def kind(i: int) -> str:
            _, c, post = words[i]
            if i == 0 or not c.isalpha() or post:
                return ""
            if c[:1].isupper():
                return "name"
            return "noun" if self._common(c.lower()) and self._noun(c.lower()) else ""

        content = [i for i in range(len(words)) if kind(i)]
        pairs = [
            (i, j)
            for i in content
            for j in content
            if 1 < j - i <= 3
            and kind(i) == kind(j)
            and all(not words[k][2] and not words[k][0] for k in range(i, j))
        ]
        if not pairs:
            return None
        i, j = self.rng.choice(pairs)
        between = {words[k][1].lower() for k in range(i + 1, j)}
        symmetric = between & {"and", "or", "vs", "versus"}
        words[i], words[j] = (
            (words[i][0], words[j][1], words[i][2]),
            (words[j][0], words[i][1], words[j][2]),
        )
        if symmetric:
            return Generated("gen_symmetric_swap", 1, text, _join(words))
        return Generated("gen_swap", 0, text, _join(words))

    def modifier(self, text: str) -> Generated | None:
        words = _words(text)
        nouns = [
            i
            for i, (_, c, _) in enumerate(words)
            if i > 0
            and (c.lower(), "n") in self.senses.first
            and words[i - 1][1].lower() in ("a", "an", "the", "my", "your", "all", "this")
        ]
        if not nouns:
            return None
        i = self.rng.choice(nouns)
        words.insert(i, ("", self.rng.choice(MODIFIERS), ""))
        return Generated("gen_modifier", 0, text, _join(words))

    def name(self, text: str) -> Generated | None:
        def pick(core: str) -> str | None:
            if not core[:1].isupper() or core.lower() in self.lex.synsets or not self.names:
                return None
            return self.rng.choice(self.names)

        words = _words(text)
        if len(words) < 2:
            return None
        first, rest = words[0], _join(words[1:])
        found = self._replace_one(rest, pick, "gen_name", 0)
        if found is None:
            return None
        return Generated(found.source, 0, text, _join([first]) + " " + found.text_b)

    # -- label 1 ------------------------------------------------------------------------
    def synonym(self, text: str) -> Generated | None:
        def pick(core: str) -> str | None:
            low = core.lower()
            if not self._common(low):
                return None
            if len(self.lex.synsets.get(low, ())) > 3:
                return None  # too ambiguous: another lemma of the wrong sense is no synonym
            for pos in ("v", "a", "n", "r"):
                sid = self.senses.first.get((low, pos))
                if sid is not None:
                    options = [w for w in self._members.get(sid, ()) if w != low]
                    return self.rng.choice(sorted(options)) if options else None
            return None

        return self._replace_one(text, pick, "gen_synonym", 1)

    def contraction(self, text: str) -> Generated | None:
        low = text.lower()
        for long_, short in CONTRACT.items():
            pos = low.find(long_)
            if pos >= 0 and (pos == 0 or not low[pos - 1].isalpha()):
                new = text[:pos] + _match_case(short, text[pos:]) + text[pos + len(long_) :]
                return Generated("gen_contraction", 1, text, new)
            pos = low.find(short.lower())
            if pos >= 0:
                new = text[:pos] + _match_case(long_, text[pos:]) + text[pos + len(short) :]
                return Generated("gen_contraction", 1, text, new)
        return None

    def typo(self, text: str) -> Generated | None:
        words = _words(text)
        candidates = [i for i, (_, c, _) in enumerate(words) if c.isalpha() and len(c) >= 5]
        if not candidates:
            return None
        for i in self.rng.sample(candidates, min(len(candidates), self.rng.choice([1, 2]))):
            pre, core, post = words[i]
            k = self.rng.randrange(1, len(core) - 1)
            kind = self.rng.choice(["drop", "swap", "double", "replace"])
            if kind == "drop":
                core = core[:k] + core[k + 1 :]
            elif kind == "swap":
                core = core[:k] + core[k + 1] + core[k] + core[k + 2 :]
            elif kind == "double":
                core = core[:k] + core[k] + core[k:]
            else:
                core = core[:k] + self.rng.choice("aeioulnrst") + core[k + 1 :]
            words[i] = (pre, core, post)
        return Generated("gen_typo", 1, text, _join(words))

    def casing(self, text: str) -> Generated | None:
        new = text.lower().rstrip("?.! ")
        return Generated("gen_casing", 1, text, new) if new != text else None

    def front_clause(self, text: str) -> Generated | None:
        words = _words(text.rstrip())
        preps = ("in", "on", "for", "with", "during", "after", "before", "using", "without")
        for i in range(len(words) - 1, 1, -1):
            if words[i][1].lower() in preps and len(words) - i <= 5 and i >= 3:
                tail = [(p, c, "") for p, c, _ in words[i:]]
                end = words[-1][2] or ""
                head = words[:i]
                first = head[0]
                head[0] = (first[0], first[1][:1].lower() + first[1][1:], first[2])
                t0 = tail[0]
                tail[0] = (t0[0], t0[1][:1].upper() + t0[1][1:], t0[2])
                tail[-1] = (tail[-1][0], tail[-1][1], ",")
                return Generated("gen_front_clause", 1, text, _join(tail + head) + end)
        return None

    def frame(self, text: str) -> Generated | None:
        low = text.lower()
        for old, new in (
            ("how do i", "how can i"),
            ("how can i", "how do i"),
            ("how to", "how do i"),
        ):
            pos = low.find(old)
            if pos >= 0:
                return Generated(
                    "gen_frame",
                    1,
                    text,
                    text[:pos] + _match_case(new, text[pos:]) + text[pos + len(old) :],
                )
        pattern = self.rng.choice(POLITE)
        return Generated("gen_frame", 1, text, pattern.format(text))

    def all_for(self, text: str) -> list[Generated]:
        makers = (
            self.negate,
            self.antonym,
            self.sibling,
            self.number,
            self.closed_class,
            self.swap,
            self.modifier,
            self.name,
            self.synonym,
            self.contraction,
            self.typo,
            self.casing,
            self.front_clause,
            self.frame,
        )
        out = []
        for make in makers:
            pair = make(text)
            if pair is not None and pair.text_b.strip() and pair.text_b != text:
                out.append(pair)
        return out


def capitalised_names(texts: Sequence[str], lexicon: Lexicon) -> list[str]:
    """Capitalised words (not sentence-initial) that WordNet does not know: names."""
    seen: dict[str, None] = {}
    for text in texts:
        for word in _words(text)[1:]:
            core = word[1]
            if core[:1].isupper() and core.isalpha() and core.lower() not in lexicon.synsets:
                seen[core] = None
    return sorted(seen)


def generate(seeds: Sequence[str], lexicon: Lexicon, seed: int = 0) -> list[Generated]:
    perturber = Perturber(lexicon, SenseOrder(), capitalised_names(seeds, lexicon), seed)
    out: list[Generated] = []
    for text in seeds:
        out.extend(perturber.all_for(text))
    return out
