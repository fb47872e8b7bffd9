"""The gate's training pairs, their embeddings and features, in one table.

Three origins, each pair with a ``source`` (its kind) and a ``group`` (for grouped CV):

* ``gen``: perturbations of real questions (``cache.training.perturb``), grouped by seed;
* ``dev``: ``pairs_dev.tsv`` (news sentences, question pairs) and
* ``nearmiss``: ``pairs_nearmiss_dev.tsv``, both grouped by topic: pairs whose first texts are
  close in embedding space (agglomerated by cosine) share a group, so a topic-disjoint split
  never puts "the CEO of AMD" in training and "the CEO of Nvidia" in the test (nor two news
  sentences about one event).

Each pair is also marked a statement pair or not (``cache.statements``); statement pairs carry
the statement features the statement gate reads besides the request features.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cache.embedder import SentenceTransformerEmbedder
from cache.lexicon import Lexicon
from cache.pairfeatures import feature_matrix
from cache.statements import STATEMENT_FEATURE_NAMES, statement_features, statement_pair
from cache.training.data import paraphrase_file, seed_questions
from cache.training.pairs import Pair, default_embedding_cache, embed_cached, read_pairs
from cache.training.perturb import generate

ORIGINS = ("gen", "dev", "nearmiss")
TOPIC_COSINE = 0.6  # first texts at least this close share a topic group


@dataclass
class Table:
    origin: npt.NDArray[np.str_]
    source: npt.NDArray[np.str_]
    label: npt.NDArray[np.int64]
    group: npt.NDArray[np.int64]
    cosine: npt.NDArray[np.float64]
    x: npt.NDArray[np.float64]
    text_a: list[str]
    text_b: list[str]
    statement: npt.NDArray[np.bool_]
    extra: npt.NDArray[np.float64]  # statement features (zeros for other pairs)

    def where(self, mask: npt.NDArray[np.bool_]) -> Table:
        idx = np.nonzero(mask)[0]
        return Table(
            self.origin[idx],
            self.source[idx],
            self.label[idx],
            self.group[idx],
            self.cosine[idx],
            self.x[idx],
            [self.text_a[i] for i in idx],
            [self.text_b[i] for i in idx],
            self.statement[idx],
            self.extra[idx],
        )


def topic_groups(emb: npt.NDArray[np.float32], threshold: float = TOPIC_COSINE) -> list[int]:
    """Single-link groups of rows whose cosine reaches ``threshold`` (union-find)."""
    parent = list(range(len(emb)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    sims = emb @ emb.T
    rows, cols = np.nonzero(np.triu(sims >= threshold, 1))
    for i, j in zip(rows.tolist(), cols.tolist(), strict=True):
        parent[find(i)] = find(j)
    return [find(i) for i in range(len(emb))]


def _embed(
    embedder: SentenceTransformerEmbedder, pairs: list[Pair], cache: Path
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    a = embed_cached(embedder, [p.text_a for p in pairs], cache)
    b = embed_cached(embedder, [p.text_b for p in pairs], cache)
    return a, b


def generated_pairs(n_seeds: int, per_source: int, seed: int, lexicon: Lexicon) -> list[Pair]:
    seeds = seed_questions()
    rng = random.Random(seed)
    rng.shuffle(seeds)
    made = generate(seeds[:n_seeds], lexicon, seed)
    by_source: dict[str, list[Pair]] = {}
    for g in made:
        by_source.setdefault(g.source, []).append(Pair(g.source, g.label, g.text_a, g.text_b))
    out: list[Pair] = []
    for source in sorted(by_source):
        items = by_source[source]
        rng.shuffle(items)
        out.extend(items[:per_source])
    return out


def build(
    n_seeds: int = 3000,
    per_source: int = 1200,
    seed: int = 0,
    embedding_cache: Path | None = None,
) -> Table:
    lexicon = Lexicon.shared()
    cache = embedding_cache or default_embedding_cache()
    embedder = SentenceTransformerEmbedder()
    parts = {
        "gen": generated_pairs(n_seeds, per_source, seed, lexicon),
        "dev": read_pairs(paraphrase_file("pairs_dev.tsv")),
        "nearmiss": read_pairs(paraphrase_file("pairs_nearmiss_dev.tsv")),
    }
    origin: list[str] = []
    source: list[str] = []
    label: list[int] = []
    group: list[int] = []
    cosine: list[float] = []
    text_a: list[str] = []
    text_b: list[str] = []
    offset = 0
    for name in ORIGINS:
        pairs = parts[name]
        a, b = _embed(embedder, pairs, cache)
        if name == "gen":
            seen: dict[str, int] = {}
            groups = [seen.setdefault(p.text_a, len(seen)) for p in pairs]
        else:
            groups = topic_groups(a)
        origin += [name] * len(pairs)
        source += [p.source for p in pairs]
        label += [p.label for p in pairs]
        group += [offset + g for g in groups]
        offset += max(groups, default=0) + 1
        cosine += np.einsum("ij,ij->i", a, b).astype(np.float64).tolist()
        text_a += [p.text_a for p in pairs]
        text_b += [p.text_b for p in pairs]
    x = feature_matrix(text_a, text_b, cosine, lexicon)
    statement, extra = statement_part(text_a, text_b, lexicon)
    return Table(
        np.array(origin),
        np.array(source),
        np.array(label, dtype=np.int64),
        np.array(group, dtype=np.int64),
        np.array(cosine),
        x,
        text_a,
        text_b,
        statement,
        extra,
    )


def statement_part(
    text_a: list[str], text_b: list[str], lex: Lexicon
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float64]]:
    """Which pairs are statement pairs, and their statement features."""
    statement = np.array(
        [statement_pair(a, b, lex) for a, b in zip(text_a, text_b, strict=True)], dtype=bool
    ).reshape(len(text_a))
    extra = np.zeros((len(text_a), len(STATEMENT_FEATURE_NAMES)))
    for i in np.nonzero(statement)[0]:
        extra[i] = statement_features(text_a[i], text_b[i], lex)
    return statement, extra
