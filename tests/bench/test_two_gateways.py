"""Two gateway instances in front of one simulated pool (bench/two_gateways.py, virtual time).

With KV events both instances see every replica's blocks, so splitting the traffic between
them must not cost hits; the approximate index learns only from each instance's own traffic,
so it loses some (docs/benchmarks.md measures how much) but must stay well above round-robin.
Margins are generous: the run is deterministic, the bounds only guard the qualitative property.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.prefix_routing import Scale, SegmentTokenizer, SharedPrefix
from bench.sim.params import load_profile
from bench.two_gateways import run_setup

SCALE = Scale(
    duration_s=20.0, tenants=24, rate=20.0, zipf=0.3, conversations=0, conv_rate=0.0,
    no_reuse_rate=0.0, warmup_s=4.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def hit_rates() -> dict[tuple[str, int], float]:
    # 1,536 blocks of 16 tokens per replica: the 24 tenants' prompts (~66k tokens) take most of
    # the pool's cache (98k tokens), so where each tenant lives decides the hit rate.
    params = load_profile("h100-llama3-8b", num_gpu_blocks=1536)
    tok = SegmentTokenizer()
    workload = SharedPrefix(SCALE, 1, tok, 4)
    out: dict[tuple[str, int], float] = {}
    for strategy, instances in [
        ("round_robin", 1),
        ("prefix", 1),
        ("prefix", 2),
        ("prefix_precise", 1),
        ("prefix_precise", 2),
    ]:
        row: dict[str, Any] = run_setup(
            strategy, workload, params, 4, SCALE, tok, instances, "random", 1
        )
        out[strategy, instances] = float(row["hit_rate"])
    return out


def test_precise_instances_share_the_truth(hit_rates: dict[tuple[str, int], float]) -> None:
    assert hit_rates["prefix_precise", 2] >= hit_rates["prefix_precise", 1] - 0.03


def test_approximate_instances_lose_hits_but_beat_round_robin(
    hit_rates: dict[tuple[str, int], float],
) -> None:
    assert hit_rates["prefix", 2] <= hit_rates["prefix", 1] + 0.01
    assert hit_rates["prefix", 2] >= 1.5 * hit_rates["round_robin", 1]
