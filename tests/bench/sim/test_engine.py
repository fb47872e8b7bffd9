"""The simulated replica's engine: prefix cache, eviction, queueing and step timing.

The engine is pure: these tests drive it with a synthetic clock, step by step.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.sim.engine import ReplicaEngine, RequestOutput, RequestRejected
from bench.sim.hashing import block_hash_chain, external_hash, prefix_block_hashes
from bench.sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from bench.sim.params import SimParams, list_profiles, load_profile


def params(**changes: object) -> SimParams:
    base: dict[str, object] = {
        "name": "test",
        "description": "small engine for tests",
        "source": "tests",
        "block_size": 4,
        "num_gpu_blocks": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "request_overhead_ms": 0.0,
        "step_base_ms": 5.0,
        "prefill_ms_per_token": 0.1,
        "decode_ms_per_seq": 0.5,
    }
    base.update(changes)
    return SimParams.model_validate(base)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class Driver:
    """Steps an engine on a synthetic clock and keeps what came out."""

    def __init__(self, engine: ReplicaEngine) -> None:
        self.engine = engine
        self.now = 0.0
        self.events: list[KvEvent] = []
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.first_token_at: dict[str, float] = {}
        self.decode_steps: list[tuple[int, float]] = []  # (decoding seqs, duration) per step

    def add(self, rid: str, ids: Sequence[int], max_tokens: int = 2) -> None:
        self.engine.add_request(rid, ids, max_tokens, self.now)

    def step(self) -> None:
        start = self.engine.next_step_time()
        assert start is not None
        result = self.engine.step(max(start, self.now))
        self.now = result.end
        self.events.extend(result.kv_events)
        if result.prefill_tokens == 0:
            self.decode_steps.append((result.decode_seqs, result.end - result.start))
        for out in result.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)
            self.first_token_at.setdefault(out.request_id, result.end)

    def run(self) -> None:
        for _ in range(10_000):
            if self.engine.next_step_time() is None:
                return
            self.step()
        raise AssertionError("the engine never went idle")


def test_profiles_load_and_state_sources() -> None:
    names = list_profiles()
    assert {"h100-llama3-8b", "a10g-llama3-8b", "cpu-tiny-llama"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name
        assert len(p.source) > 40
        assert p.kv_capacity_tokens >= p.max_model_len


def test_repeated_prompt_hits_prefix_cache_in_tokens() -> None:
    d = Driver(ReplicaEngine(params()))
    ids = prompt(100, 18)  # 4 full blocks + 2 tokens
    d.add("a", ids)
    d.run()
    d.add("b", ids)
    d.run()
    c = d.engine.snapshot()
    assert c.prefix_cache_queries == 36
    assert c.prefix_cache_hits == 16  # 4 full blocks; the partial block is recomputed
    assert c.hit_rate == pytest.approx(16 / 36)
    assert d.outputs["b"][0].num_cached_tokens == 16
    assert [o.new_token_ids for o in d.outputs["a"]] == [o.new_token_ids for o in d.outputs["b"]]
    assert d.first_token_at["b"] - 0 > 0
    stored = [e for e in d.events if isinstance(e, BlockStored)]
    announced = [h for e in stored for h in e.block_hashes]
    assert announced[:4] == prefix_block_hashes(ids, 4)  # b's hits were not re-announced
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == ids[:16]


def test_whole_prompt_cached_still_recomputes_last_token() -> None:
    d = Driver(ReplicaEngine(params()))
    ids = prompt(0, 16)  # exactly 4 blocks
    d.add("a", ids)
    d.run()
    d.add("b", ids)
    d.run()
    assert d.outputs["b"][0].num_cached_tokens == 12


def test_warm_ttft_is_shorter_by_the_cached_prefill() -> None:
    d = Driver(ReplicaEngine(params()))
    ids = prompt(0, 100)
    t0 = d.now
    d.add("cold", ids, max_tokens=1)
    d.run()
    cold = d.first_token_at["cold"] - t0
    t1 = d.now
    d.add("warm", ids, max_tokens=1)
    d.run()
    warm = d.first_token_at["warm"] - t1
    assert cold == pytest.approx((5.0 + 100 * 0.1) / 1000)
    assert warm == pytest.approx((5.0 + 4 * 0.1) / 1000)  # 96 tokens cached, 4 computed


def test_lru_eviction_at_capacity_removes_oldest_prefix() -> None:
    # 16 blocks of 4 tokens; each prompt fills 7 full blocks (+ generated tokens).
    d = Driver(ReplicaEngine(params(num_gpu_blocks=16, max_model_len=64)))
    a, b, c = prompt(1000, 29), prompt(2000, 29), prompt(3000, 29)
    for rid, ids in (("a", a), ("b", b), ("c", c)):
        d.add(rid, ids)
        d.run()
    removed = {h for e in d.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed  # the pool is full: caching c evicted something
    assert removed == set(prefix_block_hashes(a, 4))  # a, the least recently used, went first
    d.add("b2", b)
    d.run()
    assert d.outputs["b2"][0].num_cached_tokens == 28  # b, more recent than a, survived
    d.add("a2", a)
    d.run()
    assert d.outputs["a2"][0].num_cached_tokens < 28


def test_queueing_beyond_max_num_seqs() -> None:
    d = Driver(ReplicaEngine(params(max_num_seqs=2)))
    for i in range(5):
        d.add(f"r{i}", prompt(100 * i, 8), max_tokens=4)
    d.step()
    assert d.engine.num_running == 2
    assert d.engine.num_waiting == 3
    d.run()
    firsts = sorted(d.first_token_at.values())
    # r0/r1 come out of the first step; r4 only after two pairs finished their 4 tokens.
    assert d.first_token_at["r0"] == d.first_token_at["r1"] == firsts[0]
    assert d.first_token_at["r4"] > d.first_token_at["r3"] > d.first_token_at["r1"]
    assert d.engine.snapshot().request_success == 5


def test_decode_step_time_grows_with_batch() -> None:
    p = params(max_num_seqs=16, decode_ms_per_kv_token=0.001)
    d = Driver(ReplicaEngine(p))
    d.add("solo", prompt(0, 8), max_tokens=4)
    d.run()
    solo = {n: t for n, t in d.decode_steps}
    d.decode_steps.clear()
    for i in range(16):
        d.add(f"b{i}", prompt(1000 * (i + 1), 8), max_tokens=4)
    d.run()
    batch = {n: t for n, t in d.decode_steps}
    assert 16 in batch and 1 in solo
    assert batch[16] > solo[1]
    assert batch[16] == pytest.approx((5.0 + 16 * 0.5 + 16 * 10 * 0.001) / 1000, rel=0.02)


def test_chunked_prefill_respects_token_budget() -> None:
    d = Driver(ReplicaEngine(params(max_num_batched_tokens=32)))
    d.add("long", prompt(0, 100), max_tokens=1)
    steps = 0
    while "long" not in d.outputs:
        d.step()
        steps += 1
    assert steps == 4  # 32 + 32 + 32 + 4 tokens


def test_preemption_when_blocks_run_out() -> None:
    d = Driver(ReplicaEngine(params(num_gpu_blocks=8, max_model_len=32, block_size=4)))
    d.add("x", prompt(0, 12), max_tokens=16)
    d.add("y", prompt(500, 12), max_tokens=16)
    d.run()
    c = d.engine.snapshot()
    assert c.request_success == 2
    assert c.num_preemptions >= 1
    assert sum(len(o) for o in d.outputs.values()) >= 32


def test_abort_frees_blocks() -> None:
    d = Driver(ReplicaEngine(params()))
    d.add("a", prompt(0, 40), max_tokens=50)
    d.step()
    assert d.engine.snapshot().kv_cache_usage_perc > 0
    assert d.engine.abort_request("a")
    assert d.engine.snapshot().kv_cache_usage_perc == 0
    assert d.engine.next_step_time() is None


def test_rejects_prompts_longer_than_the_model() -> None:
    e = ReplicaEngine(params(max_model_len=32))
    with pytest.raises(RequestRejected, match="maximum context length"):
        e.add_request("big", prompt(0, 30), 8, 0.0)
    with pytest.raises(RequestRejected):
        e.add_request("empty", [], 8, 0.0)


def test_reset_prefix_cache_clears_and_announces() -> None:
    d = Driver(ReplicaEngine(params()))
    d.add("a", prompt(0, 20))
    d.run()
    assert d.engine.reset_prefix_cache()
    assert isinstance(d.engine.pool.take_events()[-1], AllBlocksCleared)
    d.add("b", prompt(0, 20))
    d.run()
    assert d.outputs["b"][0].num_cached_tokens == 0


def test_block_hashes_chain_like_vllm() -> None:
    ids = prompt(7, 40)
    chain = block_hash_chain(ids, 16)
    assert len(chain) == 2
    assert block_hash_chain(ids[:16], 16) == chain[:1]  # a prefix shares its blocks
    assert block_hash_chain(prompt(8, 40), 16)[0] != chain[0]
    assert prefix_block_hashes(ids, 16) == [external_hash(h) for h in chain]
    assert block_hash_chain(ids, 16, "sha256_cbor") != chain


def test_same_inputs_same_outputs() -> None:
    def run() -> list[tuple[str, tuple[int, ...], float]]:
        d = Driver(ReplicaEngine(params(max_num_seqs=3)))
        for i in range(6):
            d.add(f"r{i}", prompt(10 * (i % 2), 30), max_tokens=3)
        d.run()
        return [(k, o.new_token_ids, d.first_token_at[k]) for k, v in d.outputs.items() for o in v]

    assert run() == run()


def test_priority_policy_serves_lower_values_first() -> None:
    d = Driver(ReplicaEngine(params(max_num_seqs=1, scheduling_policy="priority")))
    d.add("running", prompt(0, 8), max_tokens=3)
    d.step()
    for rid, prio in (("batch", 5), ("interactive", -1), ("normal", 0)):
        d.engine.add_request(rid, prompt(100 + len(rid), 8), 3, d.now, priority=prio)
    d.run()
    order = sorted(("batch", "interactive", "normal"), key=d.first_token_at.__getitem__)
    assert order == ["interactive", "normal", "batch"]


VLLM_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
_VLLM_HASHES = """
import json, sys
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils as k
ids, out = json.loads(sys.stdin.read()), {}
for name, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
    k.init_none_hash(fn)
    parent, chain = None, []
    for i in range(0, len(ids) - 15, 16):
        parent = k.hash_block_tokens(fn, parent, ids[i : i + 16], None)
        chain.append(k.maybe_convert_block_hash(parent))
    out[name] = chain
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_block_hashes_equal_real_vllms() -> None:
    if not (VLLM_PYTHON.parent.parent / ".complete").exists():
        pytest.fail("no vLLM environment (.venv-vllm): run `make vllm-env`")
    ids = [*prompt(5, 50), 70_000, 2**20, 3]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _VLLM_HASHES],
        input=json.dumps(ids),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    real = json.loads(done.stdout.strip().splitlines()[-1])
    assert real["sha256"] == prefix_block_hashes(ids, 16, "sha256")
    assert real["sha256_cbor"] == prefix_block_hashes(ids, 16, "sha256_cbor")
