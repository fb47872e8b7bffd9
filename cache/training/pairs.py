"""Labelled paraphrase pairs (TSV: source, label, text_a, text_b) and their embeddings.

Offline tools (training, evaluation, benchmarks) embed thousands of texts; the vectors are
kept in a small on-disk cache (default: the system temp dir) keyed by the texts and the model,
so reruns cost no CPU.
"""

from __future__ import annotations

import csv
import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache.embedder import SentenceTransformerEmbedder, Vectors


@dataclass(frozen=True, slots=True)
class Pair:
    source: str
    label: int
    text_a: str
    text_b: str


def read_pairs(path: str | Path) -> list[Pair]:
    pairs: list[Pair] = []
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or header[:4] != ["source", "label", "text_a", "text_b"]:
            raise ValueError(f"{path}: expected the header source, label, text_a, text_b")
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) < 4 or row[1] not in ("0", "1"):
                raise ValueError(f"{path}:{line_no}: expected 4 columns with label 0 or 1")
            pairs.append(Pair(row[0], int(row[1]), row[2], row[3]))
    return pairs


def default_embedding_cache() -> Path:
    return Path(tempfile.gettempdir()) / "llm-gateway-embeddings"


def embed_cached(
    embedder: SentenceTransformerEmbedder,
    texts: Sequence[str],
    cache_dir: Path | None = None,
) -> Vectors:
    """``embedder.embed_sync(texts)``, read from ``cache_dir`` when computed before."""
    digest = hashlib.sha256(f"{embedder.model_id}\x00{embedder.dim}".encode())
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    directory = cache_dir or default_embedding_cache()
    path = directory / f"{digest.hexdigest()[:24]}.npy"
    if path.is_file():
        cached = np.load(path)
        if cached.shape == (len(texts), embedder.dim):
            return np.asarray(cached, dtype=np.float32)
    vectors = embedder.embed_sync(texts)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, vectors)
    os.replace(tmp, path)
    return vectors
