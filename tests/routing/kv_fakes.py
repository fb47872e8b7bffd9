"""A fake vLLM KV-event publisher on real ZMQ sockets, and builders for its events."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [17966083335939800687, 5389192360090007439],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class FakePublisher:
    """vLLM's publisher shape, on XPUB so the test can wait for the subscription."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a backlog is queued, never dropped
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.kept: dict[int, bytes] = {}
        self.replay_requests: list[int] = []

    async def subscribed(self) -> None:
        frame = await self.pub.recv()
        assert frame[0] == 1

    async def publish(self, seq: int, events: list[Any], *, keep_only: bool = False) -> None:
        await self.publish_payload(seq, msgpack.packb([0.0, events, 0]), keep_only=keep_only)

    async def publish_payload(self, seq: int, payload: bytes, *, keep_only: bool = False) -> None:
        self.kept[seq] = payload
        if not keep_only:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def forget_before(self, seq: int) -> None:
        """The replay buffer no longer holds the batches before ``seq``."""
        for old in [s for s in self.kept if s < seq]:
            del self.kept[old]

    async def serve_replay(self) -> None:
        client, _, start = await self.router.recv_multipart()
        first = int.from_bytes(start, "big")
        self.replay_requests.append(first)
        for seq in sorted(s for s in self.kept if s >= first):
            await self.router.send_multipart(
                [client, b"", b"kv", seq.to_bytes(8, "big"), self.kept[seq]]
            )
        await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def serve_replays(self) -> None:
        """Answer replay requests until cancelled (a task beside the test)."""
        while True:
            await self.serve_replay()

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def block(h: int, parent: int | None, text: str) -> dict[str, Any]:
    return {**STORED_MAP, "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": ids(text), "block_size": 4}  # fmt: skip


async def wait_for(cond: Any, timeout_s: float = 5.0) -> None:
    """Poll a condition the subscriber task makes true (it exposes no event to await)."""
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
