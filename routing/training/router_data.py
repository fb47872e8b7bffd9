"""Labelled routing data: JSONL rows, their embeddings (cached on disk) and training records.

Rows carry ``prompt``, ``small_correct``, ``large_correct`` and optionally ``small_response``
and ``small_logprobs``. ``PromptFilter`` remembers which prompts an artifact was trained on, so
evaluations can keep training rows out of in-sample scoring.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.difficulty import EMBEDDING_MODEL

FloatArray = npt.NDArray[np.float64]
Embed = Callable[[Sequence[str]], FloatArray]


@dataclass(frozen=True)
class LabelledRow:
    prompt: str
    small_correct: bool
    large_correct: bool
    small_response: str | None = None
    small_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class DataFile:
    path: str
    sha256: str
    rows: tuple[LabelledRow, ...]

    @property
    def name(self) -> str:
        return Path(self.path).stem


@dataclass(frozen=True)
class PromptFilter:
    """A Bloom filter of the training prompts: which rows of other data the artifact has seen.

    Kept in the artifact (about 1.8 bytes a prompt at a 0.1 % false-positive rate) so that an
    evaluation never scores a training row in-sample, even in a file cut from the training data.
    """

    bits: int
    hashes: int
    data: bytes

    @classmethod
    def build(cls, prompts: Sequence[str], false_positive: float = 1e-3) -> PromptFilter:
        n = max(len(prompts), 1)
        bits = max(64, math.ceil(-n * math.log(false_positive) / math.log(2) ** 2))
        hashes = max(1, round(bits / n * math.log(2)))
        table = bytearray((bits + 7) // 8)
        built = cls(bits, hashes, b"")
        for prompt in prompts:
            for position in built._positions(prompt):
                table[position // 8] |= 1 << (position % 8)
        return cls(bits, hashes, bytes(table))

    def _positions(self, prompt: str) -> list[int]:
        digest = hashlib.sha256(prompt.strip().encode("utf-8")).digest()
        first = int.from_bytes(digest[:8], "little")
        step = int.from_bytes(digest[8:16], "little") | 1
        return [(first + i * step) % self.bits for i in range(self.hashes)]

    def __contains__(self, prompt: object) -> bool:
        if not isinstance(prompt, str):
            return False
        return all(self.data[p // 8] >> (p % 8) & 1 for p in self._positions(prompt))

    def to_json(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "hashes": self.hashes,
            "base64": base64.b64encode(self.data).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PromptFilter:
        table = base64.b64decode(data["base64"])
        bits, hashes = int(data["bits"]), int(data["hashes"])
        if bits < 1 or hashes < 1 or len(table) * 8 < bits:
            raise ValueError("malformed prompt filter")
        return cls(bits, hashes, table)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{where}: expected true/false, got {value!r}")


def load_data(path: str | Path) -> DataFile:
    rows: list[LabelledRow] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from exc
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f"{where}: a row needs a string 'prompt'")
            response = item.get("small_response")
            logprobs = item.get("small_logprobs")
            rows.append(
                LabelledRow(
                    prompt=item["prompt"],
                    small_correct=_bool(item.get("small_correct"), f"{where} small_correct"),
                    large_correct=_bool(item.get("large_correct"), f"{where} large_correct"),
                    small_response=response if isinstance(response, str) else None,
                    small_logprobs=tuple(float(v) for v in logprobs) if logprobs else None,
                )
            )
    if not rows:
        raise ValueError(f"{path}: no rows")
    return DataFile(str(path), file_sha256(path), tuple(rows))


def labels(rows: Sequence[LabelledRow]) -> tuple[FloatArray, FloatArray]:
    small = np.array([r.small_correct for r in rows], dtype=np.float64)
    large = np.array([r.large_correct for r in rows], dtype=np.float64)
    return small, large


def default_embedding_cache() -> Path:
    configured = os.environ.get("LLM_GATEWAY_EMBEDDING_CACHE")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "llm-gateway-emb"


def cached_embedder(cache_dir: Path | None = None, threads: int = 1) -> Embed:
    """Embed with the gateway's embedder, caching the vectors of each text list on disk."""
    directory = cache_dir or default_embedding_cache()
    loaded: list[Any] = []

    def embed(texts: Sequence[str]) -> FloatArray:
        digest = hashlib.sha256(EMBEDDING_MODEL.encode())
        for text in texts:
            digest.update(hashlib.sha256(text.encode("utf-8")).digest())
        target = directory / f"{digest.hexdigest()[:32]}.npy"
        if target.is_file():
            cached: FloatArray = np.load(target).astype(np.float64)
            if cached.shape[0] == len(texts):
                return cached
        if not loaded:
            from cache.embedder import SentenceTransformerEmbedder

            loaded.append(SentenceTransformerEmbedder(threads=threads))
        vectors = np.asarray(loaded[0].embed_sync(list(texts)), dtype=np.float32)
        directory.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".tmp.npy")
        np.save(partial, vectors)
        os.replace(partial, target)
        return vectors.astype(np.float64)

    return embed
