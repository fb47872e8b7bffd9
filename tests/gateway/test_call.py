"""``UserQuery``: one embedding per request, however many stages ask and whenever they ask."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
import pytest

from gateway.call import UserQuery


class SlowEmbedder:
    """Counts its calls; each takes ``delay`` seconds (as the real one runs in a thread)."""

    def __init__(self, delay: float = 0.02, fail: bool = False) -> None:
        self.calls = 0
        self.delay = delay
        self.fail = fail

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("model gone")
        return np.full((len(texts), 4), float(len(texts[0])), dtype=np.float32)


async def test_concurrent_askers_share_one_embedding() -> None:
    embedder = SlowEmbedder()
    query = UserQuery(embedder, "hello")
    query.start()
    first, second = await asyncio.gather(query.vector(), query.vector())
    assert embedder.calls == 1
    assert first is not None and second is not None and float(first[0]) == 5.0
    assert float((await query.vector())[0]) == 5.0 and embedder.calls == 1


async def test_no_text_or_no_embedder_gives_none() -> None:
    embedder = SlowEmbedder()
    assert await UserQuery(embedder, None).vector() is None
    assert await UserQuery(embedder, "").vector() is None
    assert await UserQuery(None, "hello").vector() is None
    assert embedder.calls == 0


async def test_a_timed_out_asker_leaves_the_embedding_to_the_others() -> None:
    query = UserQuery(SlowEmbedder(delay=0.05), "hello")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await query.vector()
    assert float((await query.vector())[0]) == 5.0


async def test_an_unawaited_failure_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """An exact hit never awaits the embedding it started; its failure must not surface as
    asyncio's 'exception was never retrieved'."""
    embedder = SlowEmbedder(delay=0.0, fail=True)
    query = UserQuery(embedder, "hello")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        query.start()
        await asyncio.sleep(0.01)
        del query
        import gc

        gc.collect()
        await asyncio.sleep(0)
    assert embedder.calls == 1
    assert "never retrieved" not in caplog.text
    with pytest.raises(RuntimeError):
        await UserQuery(SlowEmbedder(delay=0.0, fail=True), "x").vector()
