"""Fixtures of the cache tests: a real redis-server per test, a fake embedder and the real one."""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import numpy as np
import pytest

from cache.embedder import SentenceTransformerEmbedder, Vectors
from cache.verifier import Verifier

DIM = 384


class HashingEmbedder:
    """Deterministic bag-of-words vectors: texts sharing words have a high cosine."""

    dim = DIM

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                h = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
                out[row, h % DIM] += 1.0 if (h >> 32) & 1 else -1.0
            norm = np.linalg.norm(out[row])
            if norm == 0:
                out[row, 0] = 1.0
            else:
                out[row] /= norm
        return out

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return self.embed_sync(texts)


@pytest.fixture
def embedder() -> HashingEmbedder:
    return HashingEmbedder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """A redis-server child process; ``stop`` kills it, ``start`` brings it back (empty)."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--loglevel", "notice"]
        self.proc = subprocess.Popen(
            [self.binary, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        # Wait for the server's own "ready" line rather than sleeping.
        for line in self.proc.stdout:
            if "Ready to accept connections" in line:
                # Keep draining its log so a full pipe can never stall the server.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
        raise RuntimeError(f"redis-server exited with {self.proc.wait()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make redis-server`")
    server = RedisServer(binary, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def minilm() -> AsyncIterator[SentenceTransformerEmbedder]:
    """The real all-MiniLM-L6-v2 embedder (bundled with the `cache` extra; no network)."""
    model = SentenceTransformerEmbedder(batch_window_s=0.005)
    yield model
    await model.aclose()


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    """The shipped verifier artifact, loaded once per module."""
    return Verifier.load()
