"""The TTFT floor (bench/_ttft_bound.py): each request's lowest possible TTFT on a pool.

Its arithmetic is checked on hand-built requests; the property that makes it a floor (no
request of a real simulated run got its first token sooner) is checked on multiturn runs of
several strategies, where the engines' queues, evictions and batching all come into play.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench._routing_des import Job, PoolRun, SimClock
from bench._ttft_bound import ttft_floors
from bench.prefix_routing import (
    MultiTurn,
    Scale,
    SegmentTokenizer,
    make_router,
)
from bench.sim.params import SimParams, load_profile

PARAMS = load_profile("h100-llama3-8b", num_gpu_blocks=4096)


def _ms(params: SimParams, computed: int, cached: int, chunks: int = 1) -> float:
    return (
        params.request_overhead_ms
        + chunks * params.step_base_ms
        + computed * params.prefill_ms_per_token
        + cached * params.prefill_ms_per_cached_token
    )


def test_first_request_of_a_group_prefills_everything() -> None:
    job = Job(0.0, "", list(range(100)), 8, "t", group="g")
    assert ttft_floors([job], PARAMS)[id(job)] * 1000 == pytest.approx(_ms(PARAMS, 100, 0))


def test_next_turn_reuses_whole_blocks_of_the_previous_turn_and_its_reply() -> None:
    first = Job(0.0, "", list(range(40)), 8, "t", group="conv")
    first.output = list(range(1000, 1010))  # the reply: 50 tokens of context in all
    # the next turn repeats the 50, then 30 new tokens: 3 whole blocks (48 tokens) reusable
    second = Job(5.0, "", first.tokens + first.output + list(range(2000, 2030)), 8, "t", "conv")
    second.group = "conv"
    other = Job(6.0, "", list(range(40)), 8, "t", group="other")  # another group: cold
    floors = ttft_floors([second, other, first], PARAMS)  # any order: sorted by arrival
    assert floors[id(second)] * 1000 == pytest.approx(_ms(PARAMS, 80 - 48, 48))
    assert floors[id(other)] * 1000 == pytest.approx(_ms(PARAMS, 40, 0))


def test_a_repeated_prompt_still_computes_its_last_block() -> None:
    first = Job(0.0, "", list(range(64)), 8, "t", group="g")
    again = Job(1.0, "", list(range(64)), 8, "t", group="g")
    # vLLM never serves the whole prompt from cache: the last token's block is recomputed
    assert ttft_floors([first, again], PARAMS)[id(again)] * 1000 == pytest.approx(
        _ms(PARAMS, 16, 48)
    )


def test_long_prompts_pay_one_step_per_prefill_chunk() -> None:
    params = load_profile("h100-llama3-8b", num_gpu_blocks=4096, max_num_batched_tokens=2048)
    job = Job(0.0, "", list(range(5000)), 8, "t", group="g")
    assert ttft_floors([job], params)[id(job)] * 1000 == pytest.approx(_ms(params, 5000, 0, 3))


def _conversations(path: Path, n: int) -> Path:
    """ShareGPT-shaped conversations of random words: 2-5 turns, some long first messages."""
    rng = random.Random(7)
    words = [f"w{i}" for i in range(3000)]
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            messages = []
            for turn in range(rng.randint(2, 5)):
                size = rng.choice((20, 80, 400, 1500)) if turn == 0 else rng.randint(5, 120)
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=size))})
                reply = " ".join(rng.choices(words, k=rng.randint(10, 150)))
                messages.append({"role": "assistant", "content": reply})
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


@pytest.mark.parametrize("strategy", ["round_robin", "prefix_precise"])
def test_no_simulated_request_beats_its_floor(strategy: str, tmp_path: Path) -> None:
    scale = Scale(
        duration_s=12.0, tenants=0, rate=0.0, zipf=0.0, conversations=120, conv_rate=15.0,
        no_reuse_rate=0.0, warmup_s=0.0,
    )  # fmt: skip
    params = load_profile("h100-llama3-8b", num_gpu_blocks=2048)
    tok = SegmentTokenizer()
    conversations = _conversations(tmp_path / "conversations.jsonl", 120)
    workload = MultiTurn(scale, 1, tok, 4, conversations, params.max_model_len)
    clock = SimClock()
    router, index = make_router(strategy, clock, tok)
    res = PoolRun(params, 4, router, clock=clock, kv_index=index).run(workload)
    floors = ttft_floors(res.jobs, params)
    served = [j for j in res.jobs if j.first_token_at is not None]
    assert len(served) > 200  # several turns per conversation were replayed
    later_turns = [j for j in served if floors[id(j)] < _ms(params, len(j.tokens), 0) / 1000]
    assert later_turns, "no request could reuse its conversation's context"
    for j in served:
        assert j.first_token_at is not None
        assert j.first_token_at - j.arrival >= floors[id(j)] - 1e-9, (j.group, len(j.tokens))
