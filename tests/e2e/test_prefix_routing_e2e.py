"""The prefix strategies behind the gateway: bounded work per decision, what callers are told."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm
from tests.routing.helpers import words, write_bpe_tokenizer


def precise_policy(urls: list[str], tokenizer: Path) -> str:
    routing = {"strategy": "prefix_precise", "tokenizer": str(tokenizer), "scrape_interval_s": 0}
    models = {"m": {"backend": "up", "model": "fake-model"}}
    return build_policy({"up": vllm(*urls, routing=routing)}, models)


async def test_a_huge_prompt_does_not_stall_other_requests(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """prefix_precise tokenizes on the event loop: a 2 MB prompt tokenized whole held every other
    request for seconds (about 4 s here); only its first ``max_prefix_chars`` are tokenized."""
    ups = [await make_fake(), await make_fake()]
    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer.json")
    gw = await make_gateway(precise_policy([u.url for u in ups], tokenizer))
    small: Any = [{"role": "user", "content": "hello"}]
    huge: Any = [{"role": "user", "content": words(270_000)}]  # about 2 MB
    await gw.client.chat.completions.create(model="m", messages=small)  # warm
    slowest = 0.0
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal slowest
        while not done.is_set():
            t0 = time.perf_counter()
            await gw.client.chat.completions.create(model="m", messages=small)
            slowest = max(slowest, time.perf_counter() - t0)
            await asyncio.sleep(0.02)

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.1)
    answer = await gw.client.chat.completions.create(model="m", messages=huge)
    done.set()
    await poller
    assert answer.choices[0].message.content
    assert slowest < 1.5, slowest
