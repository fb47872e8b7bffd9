"""KV events that go wrong: bad batches, lost batches, restarted engines, floods.

Each test runs the subscriber against a fake publisher on real ZMQ sockets (loopback TCP).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq.asyncio

from gateway.observability.metrics import KVEventCollector
from routing.kv_events import KVEventSource, KVEventSubscriber
from routing.kv_index import CallableTokenizer
from routing.pool import BackendPool, PoolSettings
from routing.prefix import PrecisePrefixRouter
from routing.replica import Replica
from tests.routing.helpers import req
from tests.routing.kv_fakes import FakePublisher, block, ids, wait_for


@dataclass
class Rig:
    fake: FakePublisher
    router: PrecisePrefixRouter
    replica: Replica

    @property
    def sub(self) -> KVEventSubscriber:
        return self.router.events.subscribers[self.replica.name]

    def matched(self, text: str) -> int:
        return self.router.blocks.probe(req(text)).matched(self.replica)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """One replica's publisher (answering replays) and a started precise router."""
    ctx = zmq.asyncio.Context()
    fake = FakePublisher(ctx)
    replica = Replica("b", "http://10.0.0.1:8000/v1")
    source = KVEventSource(replica.name, fake.endpoint, fake.replay_endpoint)
    router = PrecisePrefixRouter(
        CallableTokenizer(ids), sources=lambda _: [source], pending_ttl_s=0
    )
    replays = asyncio.create_task(fake.serve_replays())
    await router.start([replica])
    await fake.subscribed()
    try:
        yield Rig(fake, router, replica)
    finally:
        replays.cancel()
        await router.stop()
        fake.close()
        ctx.term()


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
