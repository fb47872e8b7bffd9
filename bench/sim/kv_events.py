"""A ZMQ publisher of KV-cache events with vLLM's wire format.

Each engine step's events go out as one PUB message of three frames: the topic, an 8-byte
big-endian sequence number counting from 0, and a msgpack ``[timestamp, [event maps...],
data_parallel_rank]``. The last ``buffer_steps`` messages are kept for the replay endpoint: a
DEALER sends ``[b"", start_seq]`` and receives ``[b"", topic, seq, payload]`` per kept message
at or after ``start_seq``, then ``[b"", b"", seq -1, b""]``, as vLLM's ZmqEventPublisher does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

from bench.sim.kvcache import KvEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_batch(events: Sequence[KvEvent], ts: float, data_parallel_rank: int = 0) -> bytes:
    payload: bytes = msgpack.packb([ts, [e.to_wire() for e in events], data_parallel_rank])
    return payload


class KvEventPublisher:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        host: str = "127.0.0.1",
        topic: str = "kv",
        with_replay: bool = True,
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._ctx = context
        self._host = host
        self.topic = topic.encode()
        self._with_replay = with_replay
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._dp_rank = data_parallel_rank
        self._seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None

    async def start(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port(f"tcp://{self._host}")
        self.endpoint = f"tcp://{self._host}:{port}"
        if self._with_replay:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            rport = self._replay.bind_to_random_port(f"tcp://{self._host}")
            self.replay_endpoint = f"tcp://{self._host}:{rport}"
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def publish(self, events: Sequence[KvEvent]) -> None:
        if self._pub is None or not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time(), self._dp_rank)
        self._buffer.append((seq, payload))
        await self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client_id, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
