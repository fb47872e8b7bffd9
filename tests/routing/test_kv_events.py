from __future__ import annotations

import asyncio

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
import zmq.asyncio

from routing.kv_events import KVEventHub, KVEventSource
from routing.kv_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventFormatError,
    decode_batch,
    decode_seq,
    parse_event,
)
from routing.kv_index import CallableTokenizer, KVBlockIndex, token_chain
from tests.routing.helpers import pool, req
from tests.routing.kv_fakes import STORED_MAP, FakePublisher, block, ids, wait_for


def test_parse_map_form() -> None:
    e = parse_event(STORED_MAP)
    assert isinstance(e, BlockStored)
    assert e.block_hashes == (17966083335939800687, 5389192360090007439)
    assert e.parent_block_hash is None and e.block_size == 4 and e.medium == "GPU"
    removed = parse_event({"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"})
    assert removed == BlockRemoved((1, 2), "GPU")
    assert parse_event({"type": "AllBlocksCleared"}) == AllBlocksCleared()
    assert parse_event({"type": "SomethingNew", "x": 1}) is None


def test_parse_array_form() -> None:
    e = parse_event(["BlockStored", [5, 6], 4, [1, 2, 3, 4, 5, 6, 7, 8], 4, None])
    assert e == BlockStored((5, 6), 4, (1, 2, 3, 4, 5, 6, 7, 8), 4, None, None)
    e = parse_event(["BlockStored", [b"\x01" * 32], None, [1, 2], 2, 7, "CPU"])
    assert isinstance(e, BlockStored) and e.block_hashes == (b"\x01" * 32,)
    assert e.lora_id == 7 and e.medium == "CPU"
    assert parse_event(["BlockRemoved", [9]]) == BlockRemoved((9,), None)
    assert parse_event(["AllBlocksCleared"]) == AllBlocksCleared()


def test_malformed_events_raise() -> None:
    with pytest.raises(KVEventFormatError):
        parse_event(["BlockStored", [1]])
    with pytest.raises(KVEventFormatError):
        parse_event({"type": "BlockRemoved", "block_hashes": "nope"})
    with pytest.raises(KVEventFormatError):
        parse_event(42)
    with pytest.raises(KVEventFormatError):
        decode_batch(b"\xc1")
    with pytest.raises(KVEventFormatError):
        decode_seq(b"\x00\x01")


def test_decode_batch_and_seq() -> None:
    payload = msgpack.packb([1.5, [STORED_MAP, ["BlockRemoved", [1]], {"type": "X"}], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.dp_rank == 0
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), bs)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_index_follows_stored_removed_cleared() -> None:
    index = KVBlockIndex(CallableTokenizer(ids), pending_ttl_s=0)
    r = pool(2)
    text = "abcdefghijkl"  # 3 blocks of 4
    index.apply(r[0].name, EventBatch(0, (stored([11, 12], None, ids(text[:8]), 4),)))
    # The third block comes in a later event, chained on the vLLM hash of the second.
    index.apply(r[0].name, EventBatch(0, (stored([13], 12, ids(text[8:12]), 4),)))
    probe = index.probe(req(text + "zz"))
    assert probe.matched(r[0]) == 3 and probe.matched(r[1]) == 0
    index.apply(r[0].name, EventBatch(0, (BlockRemoved((12,)),)))
    assert index.probe(req(text)).matched(r[0]) == 1  # the chain breaks at block 2
    index.apply(r[0].name, EventBatch(0, (AllBlocksCleared(),)))
    assert index.probe(req(text)).matched(r[0]) == 0


def test_index_keys_do_not_depend_on_vllm_hashes() -> None:
    index = KVBlockIndex(CallableTokenizer(ids), pending_ttl_s=0)
    r = pool(2)
    text = "abcdefgh"
    # Two replicas with different hash seeds: different vLLM hashes, same tokens.
    index.apply(r[0].name, EventBatch(0, (stored([1, 2], None, ids(text), 4),)))
    index.apply(r[1].name, EventBatch(0, (stored([901, 902], None, ids(text), 4),)))
    probe = index.probe(req(text))
    assert probe.matched(r[0]) == probe.matched(r[1]) == 2


def test_orphans_and_other_media_are_ignored() -> None:
    index = KVBlockIndex(CallableTokenizer(ids), pending_ttl_s=0)
    r = pool(1)
    index.apply(r[0].name, EventBatch(0, (stored([5], 404, ids("abcd"), 4),)))
    assert index.replicas[r[0].name].orphans == 1
    cpu = BlockStored((6,), None, tuple(ids("abcd")), 4, None, "CPU")
    index.apply(r[0].name, EventBatch(0, (cpu,)))
    assert index.held_blocks(r[0].name) == 0


def test_pending_blocks_count_until_they_expire() -> None:
    clock = Clock()
    index = KVBlockIndex(CallableTokenizer(ids), default_block_size=4, pending_ttl_s=2.0)
    index.clock = clock
    r = pool(2)
    probe = index.probe(req("abcdefgh"))
    probe.record(r[1])
    assert index.probe(req("abcdefghXY")).matched(r[1]) == 2
    clock.t = 2.5
    assert index.probe(req("abcdefghXY")).matched(r[1]) == 0
    assert token_chain(ids("abcdefgh"), 4) == index.probe(req("abcdefgh"))._chain(r[1].name)


async def test_subscriber_replays_gaps_and_detects_restarts() -> None:
    ctx = zmq.asyncio.Context()
    fake = FakePublisher(ctx)
    index = KVBlockIndex(CallableTokenizer(ids), pending_ttl_s=0)
    r = pool(1)[0]
    hub = KVEventHub(index)
    try:
        await hub.start([KVEventSource(r.name, fake.endpoint, fake.replay_endpoint)])
        await fake.subscribed()
        sub = hub.subscribers[r.name]
        await fake.publish(0, [block(1, None, "abcd")])
        await wait_for(lambda: sub.stats.last_seq == 0)
        # Batches 1 and 2 never reach the subscriber; 3 does and reveals the gap.
        await fake.publish(1, [block(2, 1, "efgh")], keep_only=True)
        await fake.publish(2, [block(3, 2, "ijkl")], keep_only=True)
        replay = asyncio.create_task(fake.serve_replay())
        await fake.publish(3, [block(4, 3, "mnop")])
        await replay
        await wait_for(lambda: sub.stats.last_seq == 3)
        assert fake.replay_requests == [1]
        assert sub.stats.gaps == 1 and sub.stats.replayed == 2 and sub.stats.lost == 0
        assert index.probe(req("abcdefghijklmnop")).matched(r) == 4
        # The engine restarts: seq 0 again, and its cache is empty.
        await fake.publish(0, [block(50, None, "zzzz")])
        await wait_for(lambda: sub.stats.restarts == 1)
        assert index.probe(req("abcdefghijklmnop")).matched(r) == 0
        assert index.probe(req("zzzz")).matched(r) == 1
    finally:
        await hub.stop()
        fake.close()
        ctx.term()
