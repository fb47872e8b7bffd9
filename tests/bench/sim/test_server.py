"""A simulated replica over HTTP and ZMQ, driven by the official openai client and a ZMQ SUB."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import openai
import pytest
import zmq
import zmq.asyncio

from bench.sim.cluster import SimCluster
from bench.sim.hashing import prefix_block_hashes
from bench.sim.tokenizer import render_chat, tokenize

PROFILE = "h100-llama3-8b"  # block size 16, like vLLM on GPUs
MODEL = "sim-llama"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a careful assistant. " * 12},
    {"role": "user", "content": "Summarise the routing study in three sentences, please."},
]


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, PROFILE, time_scale=1.0, kv_events=True) as c:
        yield c


@pytest.fixture
async def client(cluster: SimCluster) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=cluster.base_urls[0], api_key="none") as c:
        yield c


async def test_base_urls_are_distinct_loopback_v1(cluster: SimCluster) -> None:
    urls = cluster.base_urls
    assert len(set(urls)) == 2
    assert all(u.startswith("http://127.0.0.1:") and u.endswith("/v1") for u in urls)
    assert len(cluster.kv_event_endpoints) == 2


async def test_chat_non_streaming(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert resp.object == "chat.completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(tokenize(render_chat(MESSAGES)))


async def test_chat_streaming_matches_non_streaming(client: openai.AsyncOpenAI) -> None:
    plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish: list[str | None] = []
    usage = None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert "".join(pieces) == plain.choices[0].message.content  # same prompt, same output
    assert finish[-1] == "length"
    assert usage is not None
    assert usage.completion_tokens == 10
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0  # the first call cached the prefix


async def test_completions_both_ways(client: openai.AsyncOpenAI) -> None:
    resp = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert resp.choices[0].text
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 5
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == resp.choices[0].text


async def test_rejects_prompt_beyond_max_model_len(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.completions.create(model=MODEL, prompt=[5] * 8190, max_tokens=16)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="x", max_tokens=1)


async def test_models_tokenize_and_metrics(cluster: SimCluster, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    root = cluster.base_urls[0].removesuffix("/v1")
    for _ in range(2):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{root}/tokenize", json={"messages": MESSAGES}) as r:
            tok = await r.json()
        async with http.get(f"{root}/metrics") as r:
            text = await r.text()
        async with http.get(f"{root}/health") as r:
            assert r.status == 200
    ids = tokenize(render_chat(MESSAGES))
    assert tok == {"count": len(ids), "max_model_len": 8192, "tokens": ids}
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:cache_config_info",
    ):
        assert name in text, name
    samples = _samples(text)
    counters = cluster.counters()[0]
    assert samples["vllm:prefix_cache_queries_total"] == 2 * len(ids)
    assert samples["vllm:prefix_cache_hits_total"] == counters.prefix_cache_hits
    assert counters.prefix_cache_hits == (len(ids) - 1) // 16 * 16
    assert samples["vllm:time_to_first_token_seconds_count"] == 2
    assert 0 < counters.hit_rate < 1
    assert cluster.counters()[1].prefix_cache_queries == 0


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            out.setdefault(name_labels.split("{", 1)[0], float(value))
    return out


async def _recv(sock: zmq.asyncio.Socket, wait_s: float) -> list[bytes] | None:
    if not await sock.poll(int(wait_s * 1000)):
        return None
    frames: list[bytes] = await sock.recv_multipart()
    return frames


async def test_kv_events_in_vllm_framing(cluster: SimCluster, client: openai.AsyncOpenAI) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(cluster.kv_event_endpoints[0])
    try:
        # A SUB only hears messages published after its subscription reached the PUB: send
        # distinct prompts until one is heard (a handshake, not a timed wait).
        frames = None
        for i in range(50):
            msgs: list[Any] = [
                {"role": "user", "content": f"variant {i} " + "lorem ipsum dolor " * 20}
            ]
            await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
            frames = await _recv(sub, 0.2)
            if frames is not None:
                break
        assert frames is not None, "no KV event arrived"
        topic, seq, payload = frames
        assert topic == b"kv"
        assert len(seq) == 8
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        assert dp_rank == 0
        stored = events[0]
        assert stored["type"] == "BlockStored"
        assert stored["block_size"] == 16
        assert stored["parent_block_hash"] is None
        assert stored["medium"] == "GPU"
        assert len(stored["token_ids"]) == 16 * len(stored["block_hashes"])
        ids = tokenize(render_chat(msgs))
        assert stored["token_ids"] == ids[: len(stored["token_ids"])]
        assert stored["block_hashes"] == prefix_block_hashes(ids, 16)[: len(stored["block_hashes"])]
        await _check_replay(ctx, cluster.kv_replay_endpoints[0], int.from_bytes(seq, "big"))
    finally:
        sub.close(linger=0)
        ctx.term()


async def _check_replay(ctx: zmq.asyncio.Context, endpoint: str, last_seq: int) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        while True:
            frames = await _recv(dealer, 5.0)
            assert frames is not None, "replay did not answer"
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
            empty, topic, seq, payload = frames
            assert (empty, topic) == (b"", b"kv")
            assert msgpack.unpackb(payload)[1]
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(len(seqs)))
        assert last_seq in seqs
    finally:
        dealer.close(linger=0)


async def test_client_disconnect_aborts_request(
    cluster: SimCluster, client: openai.AsyncOpenAI
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True
    )
    async for _ in stream:
        break
    await stream.close()
    replica = cluster.replicas[0]
    for _ in range(500):  # poll the condition; the abort lands within a few steps
        if replica.engine.num_unfinished == 0:
            break
        await asyncio.sleep(0.01)
    assert replica.engine.num_unfinished == 0
    assert replica.engine.counters.num_aborted == 1
    assert replica.counters().request_success == 0
