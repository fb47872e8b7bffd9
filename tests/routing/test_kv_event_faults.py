"""KV events that go wrong: bad batches, lost batches, restarted engines, floods.

Each test runs the subscriber against a fake publisher on real ZMQ sockets (loopback TCP).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgpack  # type: ignore[import-untyped]
import pytest
import zmq.asyncio

from gateway.observability.metrics import KVEventCollector
from routing.kv_events import KVEventSource, KVEventSubscriber
from routing.kv_format import BlockRemoved, BlockStored, EventBatch
from routing.kv_index import CallableTokenizer, KVBlockIndex
from routing.pool import BackendPool, PoolSettings
from routing.prefix import PrecisePrefixRouter
from routing.replica import Replica
from tests.conftest import FakeFactory
from tests.routing.helpers import pool, req
from tests.routing.kv_fakes import FakePublisher, block, ids, wait_for


@dataclass
class Rig:
    fake: FakePublisher
    router: PrecisePrefixRouter
    replica: Replica
    ctx: zmq.asyncio.Context

    async def stop(self) -> None:
        await self.router.stop()
        self.fake.close()
        self.ctx.term()

    @property
    def sub(self) -> KVEventSubscriber:
        return self.router.events.subscribers[self.replica.name]

    def matched(self, text: str) -> int:
        return self.router.blocks.probe(req(text)).matched(self.replica)


async def started_rig() -> Rig:
    """One replica's publisher and a precise router following it (replays are the caller's)."""
    ctx = zmq.asyncio.Context()
    fake = FakePublisher(ctx)
    replica = Replica("b", "http://10.0.0.1:8000/v1")
    source = KVEventSource(replica.name, fake.endpoint, fake.replay_endpoint)
    router = PrecisePrefixRouter(
        CallableTokenizer(ids), sources=lambda _: [source], pending_ttl_s=0
    )
    await router.start([replica])
    await fake.subscribed()
    return Rig(fake, router, replica, ctx)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """A started rig whose publisher answers every replay."""
    started = await started_rig()
    replays = asyncio.create_task(started.fake.serve_replays())
    try:
        yield started
    finally:
        replays.cancel()
        await started.stop()


BAD_PAYLOADS = {
    "not msgpack": b"\xc1\xc1\xc1",
    "text token ids": msgpack.packb([0.0, [{**block(9, None, "wxyz"), "token_ids": ["x"] * 4}], 0]),
    "text timestamp": msgpack.packb(["not-a-time", [], 0]),
    "text block size": msgpack.packb([0.0, [{**block(9, None, "wxyz"), "block_size": "4"}], 0]),
}


@pytest.mark.parametrize("payload", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
async def test_a_bad_batch_is_skipped_and_later_batches_still_apply(
    rig: Rig, payload: bytes
) -> None:
    await rig.fake.publish(0, [block(1, None, "abcd")])
    await wait_for(lambda: rig.sub.stats.last_seq == 0)
    # The bad batch stays in the publisher's replay buffer, as it does in vLLM's.
    await rig.fake.publish_payload(1, payload)
    await rig.fake.publish(2, [block(2, None, "efgh")])
    await wait_for(lambda: rig.sub.stats.last_seq == 2)
    await rig.fake.publish(3, [block(3, 2, "ijkl")])
    await wait_for(lambda: rig.sub.stats.last_seq == 3)
    assert rig.matched("efghijkl") == 2
    # Skipped, not replayed; the subscriber never broke (errors count broken messages).
    assert rig.fake.replay_requests == []
    assert rig.sub.stats.bad_batches == 1 and rig.sub.stats.errors == 0
    # What the bad batch did is unknown: the blocks before it no longer count.
    assert rig.matched("abcd") == 0
    pool = BackendPool(
        PoolSettings("b", "vllm", (rig.replica.base_url,), None, False, 60, 1, 3, 10, False),
        rig.router,
        replicas=[rig.replica],
    )
    [family] = KVEventCollector(lambda: [pool]).collect()
    counts = {s.labels["event"]: s.value for s in family.samples}
    assert counts["bad_batches"] == 1 and counts["batches"] == 3


async def test_a_lost_removal_clears_the_replicas_blocks(rig: Rig) -> None:
    await rig.fake.publish(0, [block(1, None, "abcd")])
    await wait_for(lambda: rig.sub.stats.last_seq == 0)
    assert rig.matched("abcd") == 1
    # Batch 1 evicts "abcd"; it never arrives and is gone from the replay buffer by the time
    # batch 3 reveals the gap; batch 2 is still there.
    await rig.fake.publish(1, [{"type": "BlockRemoved", "block_hashes": [1]}], keep_only=True)
    await rig.fake.publish(2, [block(2, None, "efgh")], keep_only=True)
    rig.fake.forget_before(2)
    await rig.fake.publish(3, [block(3, 2, "ijkl")])
    await wait_for(lambda: rig.sub.stats.last_seq == 3)
    assert rig.fake.replay_requests == [1]
    assert rig.sub.stats.lost == 1 and rig.sub.stats.replayed == 1
    assert rig.matched("abcd") == 0  # a missed hit at worst, never a false one
    assert rig.matched("efghijkl") == 2  # what came after the loss counts


async def test_a_replica_back_in_service_resyncs_without_counting_losses(rig: Rig) -> None:
    # The same engine all along (no restart); its replay buffer keeps the last 5 batches.
    for seq in range(20):
        await rig.fake.publish(seq, [block(seq + 1, None, f"{seq:04d}")])
        rig.fake.forget_before(seq - 4)
    await wait_for(lambda: rig.sub.stats.last_seq == 19)
    # Out of service (a failed health check) and back: its blocks are forgotten...
    rig.router.replica_out(rig.replica)
    assert rig.matched("0019") == 0
    # ... and its next batch re-syncs from what the buffer still holds (15 to 19).
    await rig.fake.publish(20, [block(21, None, "0020")])
    await wait_for(lambda: rig.sub.stats.last_seq == 20)
    assert rig.fake.replay_requests == [0]
    assert [rig.matched(f"{seq:04d}") for seq in (14, 15, 19, 20)] == [0, 1, 1, 1]
    # Batches 0 to 14, gone from the buffer, were not lost: nothing of theirs was held.
    stats = rig.sub.stats
    assert (stats.lost, stats.gaps, stats.replayed) == (0, 0, 0)
    assert stats.resets == 1  # the forget's own, no other
    assert (stats.batches, stats.events) == (21, 21)  # each batch published counted once
    assert stats.synced == 5  # 15 to 19 applied again


def test_the_index_holds_at_most_max_blocks_per_replica() -> None:
    index = KVBlockIndex(CallableTokenizer(ids), pending_ttl_s=0, max_blocks=8)
    [r] = pool(1)
    texts = [f"{i:04d}" for i in range(20)]  # 20 one-block prefixes, never removed
    for i, text in enumerate(texts):
        index.apply(r.name, EventBatch(0, (BlockStored((i,), None, tuple(ids(text)), 4),)))
    assert index.held_blocks(r.name) == 8
    assert len(index.replicas[r.name].by_vllm_hash) == 8
    # The oldest went first; the newest still match.
    assert [index.probe(req(t)).matched(r) for t in texts[11:13]] == [0, 1]
    # Removing a dropped block later is harmless.
    index.apply(r.name, EventBatch(0, (BlockRemoved((0, 19)),)))
    assert index.held_blocks(r.name) == 7


async def test_a_replica_that_restarts_while_out_of_service_loses_its_blocks(
    make_fake: FakeFactory,
) -> None:
    up = await make_fake()
    ctx = zmq.asyncio.Context()
    fake = FakePublisher(ctx)
    settings = PoolSettings("b", "vllm", (up.url,), None, True, 60, 1, 3, 10, False)
    sources = lambda replicas: [  # noqa: E731
        KVEventSource(replicas[0].name, fake.endpoint, fake.replay_endpoint)
    ]
    router = PrecisePrefixRouter(CallableTokenizer(ids), sources=sources, pending_ttl_s=0)
    pool = BackendPool(settings, router)
    replays = asyncio.create_task(fake.serve_replays())
    await pool.start()
    try:
        await fake.subscribed()
        [replica] = pool.replicas
        sub = router.events.subscribers[replica.name]
        for seq, text in enumerate(["aaaa", "bbbb", "abcd"]):
            await fake.publish(seq, [block(seq + 1, None, text)])
        await wait_for(lambda: sub.stats.last_seq == 2)
        assert router.blocks.probe(req("abcd")).matched(replica) == 1
        # The engine goes down and its health check fails...
        up.fake.healthy = False
        await pool.refresh()
        assert not replica.healthy
        # ... and comes back as a new engine: empty cache, sequence numbers from 0, and the
        # first batches published before we hear it (seq 3 is already past the old engine's).
        fake.kept.clear()
        up.fake.healthy = True
        await pool.refresh()
        assert replica.healthy
        for seq in range(3):
            await fake.publish(seq, [block(100 + seq, None, f"new{seq}")], keep_only=True)
        await fake.publish(3, [block(103, None, "new3")])
        await wait_for(lambda: sub.stats.last_seq == 3)
        assert router.blocks.probe(req("abcd")).matched(replica) == 0
        assert fake.replay_requests == [0]  # the new engine's batches from its first
        held = [router.blocks.probe(req(f"new{i}")).matched(replica) for i in range(4)]
        assert held == [1, 1, 1, 1]
    finally:
        replays.cancel()
        await pool.stop()
        fake.close()
        ctx.term()


async def test_a_backlog_of_events_leaves_turns_to_requests(
    rig: Rig, make_fake: FakeFactory
) -> None:
    up = await make_fake()
    n = 20_000
    # Queued at once (a send that need not wait does not yield): the subscriber drains them
    # from the first turn the loop gets.
    for seq in range(n):
        await rig.fake.publish(seq, [block(seq + 1, None, f"{seq:05d}"[1:])])
    answered_while_draining = 0
    async with aiohttp.ClientSession() as http, asyncio.timeout(60):
        while rig.sub.stats.last_seq != n - 1:
            async with http.get(up.url.removesuffix("/v1") + "/health") as resp:
                assert resp.status == 200
            if rig.sub.stats.batches < n:
                answered_while_draining += 1
    assert answered_while_draining >= 3


async def test_a_forget_during_a_replay_stops_it_and_the_next_batch_resyncs() -> None:
    """A replica that leaves service while its re-sync is replaying: what the replay sends
    after the forget, and the batch that asked for it, are from before; none is applied (the
    replay applied them and set the old sequence again, so the next batch was no re-sync)."""
    started = await started_rig()
    fake, router, replica, sub = started.fake, started.router, started.replica, started.sub
    go, half_sent, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def replay_in_two_halves() -> None:
        client, _, start = await fake.router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        for seq in range(10):
            if seq == 5:
                half_sent.set()
                await go.wait()
            frames = [client, b"", b"kv", seq.to_bytes(8, "big"), fake.kept[seq]]
            await fake.router.send_multipart(frames)
        await fake.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
        done.set()

    server = asyncio.create_task(replay_in_two_halves())
    try:
        for seq in range(10):  # published before the subscriber followed: the buffer has them
            await fake.publish(seq, [block(seq + 1, None, f"{seq:04d}")], keep_only=True)
        await fake.publish(10, [block(11, None, "0010")])  # asks for a re-sync from 0
        await asyncio.wait_for(half_sent.wait(), 5)
        await wait_for(lambda: sub.stats.synced == 5)
        router.replica_out(replica)  # out of service, mid-replay
        go.set()
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.3)  # the subscriber reads the rest of the replay
        assert sub.stats.last_seq is None  # the next batch re-syncs
        assert [router.blocks.probe(req(t)).matched(replica) for t in ("0004", "0009", "0010")] == [
            0,
            0,
            0,
        ]
        assert sub.stats.synced == 5
    finally:
        server.cancel()
        await started.stop()
