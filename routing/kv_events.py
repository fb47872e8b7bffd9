"""vLLM KV-cache events: one subscriber task per replica, following its publisher.

A PUB socket emits ``[topic, seq, payload]`` (the format: routing/kv_format.py); ``seq`` counts
from 0 at engine start.

Missed batches: a ROUTER socket on the replay endpoint answers ``[b"", start_seq]`` (8 bytes)
with ``[b"", topic, seq, payload]`` for each batch it still buffers from ``start_seq`` on, then
an end marker whose seq is -1. The subscriber detects a gap (seq jumps past last + 1), replays
the missing range over a DEALER socket, then applies the live batch. A sequence number that goes
backwards means the engine restarted: its cache is empty, so the replica's state is cleared.

Re-sync. With no history of the replica (the gateway started after the engine, the engine
restarted, or the pool took the replica out of service: ``KVEventHub.forget``), a first batch
with seq > 0 triggers a replay from 0 to learn what the replay buffer (vLLM's ``buffer_steps``)
still holds. The replica's index is empty then, so the batches the buffer no longer has are not
a gap and not lost: there is nothing of theirs to doubt. Counts, so that each reads as English:
``batches`` and ``events`` are what the replica published while followed, each batch once (live,
or ``replayed`` to fill a gap); ``synced`` counts the batches a re-sync applied (after a forget,
the same engine's batches may be applied a second time).

Incomplete history. The index must only ever miss a hit, never claim a block the replica
evicted, so whenever events are missing the replica's index is cleared (``resets`` counts it):
batches a gap skipped that the replay could not supply (``lost``: gone from the buffer, no
replay endpoint, a time-out; one may have been the ``BlockRemoved`` of a block we hold), and a
batch that does not decode (``bad_batches``), skipped with its events unknown (its sequence
number is still recorded, so the next batch is not a gap: the bad batch, still in the
publisher's replay buffer, must not be replayed again and again), and a replica the pool takes
out of service (``KVEventHub.forget``): a restarted engine whose new sequence numbers are
already past the old ones would otherwise look like the same engine.

Fairness. pyzmq hands over a message already queued without a trip through the event loop, so
a backlog (a flood of events, a long replay) would hold the loop, and every request, until it
drained. Each subscriber gives the loop a turn after ``YIELD_EVERY`` units of work (a batch
counts one plus its events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from routing.kv_format import EventBatch, KVEventFormatError, decode_batch, decode_seq
from routing.replica import Replica

log = logging.getLogger(__name__)

YIELD_EVERY = 256

Came = Literal["live", "replayed", "synced"]  # how a batch reached the subscriber


class KVEventSink(Protocol):
    """Where a subscriber delivers a replica's events (routing.kv_index.KVBlockIndex)."""

    def apply(self, replica_name: str, batch: EventBatch) -> None: ...

    def reset(self, replica_name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class KVEventSource:
    replica_name: str  # Replica.name: host:port of its HTTP URL
    endpoint: str  # e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # e.g. tcp://10.0.0.5:5558
    topic: str = "kv"


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0  # published while followed: live, or replayed to fill a gap
    events: int = 0  # in those batches
    gaps: int = 0
    replayed: int = 0  # batches that filled a gap
    lost: int = 0  # batches a gap skipped that the replay buffer no longer had
    synced: int = 0  # batches a re-sync applied (see the module docstring)
    restarts: int = 0
    errors: int = 0  # messages without a sequence number we could read
    bad_batches: int = 0  # batches that did not decode, skipped
    resets: int = 0  # times the replica's index was cleared because events were missing
    last_seq: int | None = None


class KVEventSubscriber:
    """Follows one replica's KV events into a sink, replaying gaps."""

    def __init__(
        self,
        source: KVEventSource,
        sink: KVEventSink,
        context: zmq.asyncio.Context,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.source = source
        self.sink = sink
        self.stats = SubscriberStats()
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._sub: zmq.asyncio.Socket | None = None
        self._work = 0  # since the loop last had a turn
        self._forgotten = 0  # forgets so far: a replay begun before one stops taking batches
        self.connected = asyncio.Event()

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        self._sub = sub
        self.connected.set()
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._on_message(frames)
                except KVEventFormatError as exc:
                    self.stats.errors += 1
                    log.warning("kv events from %s: %s", self.source.replica_name, exc)
                await self._give_turn()
        finally:
            sub.close(linger=0)
            self._sub = None

    def forget(self) -> None:
        """Take the next batch as a first one (a re-sync); a replay running now stops taking
        batches, and the batch that asked for it is not taken either (both from before)."""
        self._forgotten += 1
        self.stats.resets += 1
        self.stats.last_seq = None

    async def _on_message(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            raise KVEventFormatError(f"expected 3 frames, got {len(frames)}")
        seq = decode_seq(frames[1])
        forgotten = self._forgotten
        last = self.stats.last_seq
        if last is not None and seq <= last:
            # Sequence numbers restart with the engine, and so does its cache.
            self.stats.restarts += 1
            self.sink.reset(self.source.replica_name)
            last = None
        if last is None and seq > 0:
            await self._replay(0, seq, resync=True)
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            await self._replay(last + 1, seq, resync=False)
        if self._forgotten == forgotten:  # else forgotten during the replay: the next re-syncs
            self._take(seq, frames[2])

    def _take(self, seq: int, payload: bytes, came: Came = "live") -> None:
        """Apply batch ``seq`` and count it; one that does not decode is skipped, counted."""
        try:
            batch = decode_batch(payload)
        except KVEventFormatError as exc:
            self.stats.bad_batches += 1
            log.warning(
                "kv events from %s: batch %d skipped: %s", self.source.replica_name, seq, exc
            )
            self._reset_index()
            self.stats.last_seq = seq
            return
        self.sink.apply(self.source.replica_name, batch)
        self._work += len(batch.events)
        if came == "synced":
            self.stats.synced += 1
        else:
            self.stats.batches += 1
            self.stats.events += len(batch.events)
            if came == "replayed":
                self.stats.replayed += 1
        self.stats.last_seq = seq

    async def _give_turn(self) -> None:
        self._work += 1
        if self._work >= YIELD_EVERY:
            self._work = 0
            await asyncio.sleep(0)

    def _reset_index(self) -> None:
        self.stats.resets += 1
        self.sink.reset(self.source.replica_name)

    async def _replay(self, start: int, stop: int, *, resync: bool) -> None:
        """Apply buffered batches ``start <= seq < stop`` from the replay endpoint. A re-sync
        starts from nothing: what it misses before its first batch is not lost."""
        reached = start
        forgotten = self._forgotten
        if self.source.replay_endpoint is not None:
            reached = await self._fetch_replay(start, stop, resync)
        if self._forgotten != forgotten:
            return
        if not resync or reached > start:
            self._missed(reached, stop)

    def _missed(self, start: int, stop: int) -> None:
        """Batches ``start <= seq < stop`` will never come: one may have removed blocks."""
        if stop > start:
            self.stats.lost += stop - start
            self._reset_index()

    async def _fetch_replay(self, start: int, stop: int, resync: bool) -> int:
        """Replay from ``start``; the seq after the last batch taken (``start`` if none)."""
        assert self.source.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        reached = start
        forgotten = self._forgotten
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not await dealer.poll(int(self._replay_timeout_s * 1000)):
                    log.warning("kv replay from %s timed out", self.source.replica_name)
                    break
                frames = await dealer.recv_multipart()
                if len(frames) < 3:
                    break
                seq = decode_seq(frames[2] if len(frames) >= 4 else frames[1])
                if seq < 0 or self._forgotten != forgotten:
                    break
                if reached <= seq < stop and len(frames) >= 4:
                    if not resync or reached > start:
                        self._missed(reached, seq)  # the buffer starts after ``start``
                    self._take(seq, frames[3], "synced" if resync else "replayed")
                    reached = seq + 1
                await self._give_turn()
        finally:
            dealer.close(linger=0)
        return reached


class KVEventHub:
    """Owns the subscriber tasks of one pool; ``start``/``stop`` fit aiohttp's cleanup_ctx."""

    def __init__(self, sink: KVEventSink, replay_timeout_s: float = 1.0) -> None:
        self.sink = sink
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._replay_timeout_s = replay_timeout_s

    async def start(self, sources: Iterable[KVEventSource]) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for source in sources:
            if source.replica_name in self._tasks:
                continue
            sub = KVEventSubscriber(source, self.sink, self._ctx, self._replay_timeout_s)
            self.subscribers[source.replica_name] = sub
            self._tasks[source.replica_name] = asyncio.create_task(
                self._supervise(sub), name=f"kv-events:{source.replica_name}"
            )
        for sub in self.subscribers.values():
            await sub.connected.wait()

    async def _supervise(self, sub: KVEventSubscriber) -> None:
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken socket must not end routing: restart it
                sub.stats.errors += 1
                log.exception("kv event subscriber for %s failed", sub.source.replica_name)
                await asyncio.sleep(1.0)

    def forget(self, replica_name: str) -> None:
        """The replica left service: it may come back as a new engine, its cache empty and its
        sequence numbers anywhere (past the old ones too), so drop its blocks and take its next
        batch as a first one (a replay from 0)."""
        self.sink.reset(replica_name)
        sub = self.subscribers.get(replica_name)
        if sub is not None:
            sub.forget()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.subscribers.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> KVEventHub:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def event_sources(
    replicas: Iterable[Replica],
    *,
    port: int = 5557,
    replay_port: int | None = 5558,
    topic: str = "kv",
    endpoints: Mapping[str, tuple[str, str | None]] | None = None,
) -> list[KVEventSource]:
    """One source per replica: ``endpoints[name or base_url]`` if given, else its host:port."""
    out: list[KVEventSource] = []
    for r in replicas:
        explicit = (endpoints or {}).get(r.name) or (endpoints or {}).get(r.base_url)
        if explicit is not None:
            out.append(KVEventSource(r.name, explicit[0], explicit[1], topic))
            continue
        host = urlsplit(r.base_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        replay = f"tcp://{host}:{replay_port}" if replay_port is not None else None
        out.append(KVEventSource(r.name, f"tcp://{host}:{port}", replay, topic))
    return out
