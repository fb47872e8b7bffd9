"""Two gateway instances, one pool: ``python -m bench.two_gateways [--quick] [--json]``.

The gateway scales out as N stateless replicas behind a load balancer. Its prefix knowledge is
not shared: ``prefix`` (approximate) learns from the requests each instance routed itself,
``prefix_precise`` from the KV events every instance subscribes to. This benchmark measures
what that costs. The same arrivals (bench.prefix_routing's workloads, its defaults) reach the
same simulated pool (4 replicas of the simulator's vLLM engine, bench/_routing_des.py, virtual
time) routed by:

- ``one``: one router instance receives every request (the baseline);
- ``two``: two independent router instances built with the same settings, each receiving a
  share of the requests as a load balancer in front of two gateway replicas would deal them
  (``--split``): ``random`` (default; seeded, each request independently), ``alternate``, or
  ``sticky`` (by user/tenant: a load balancer with session affinity).

Each instance has its own ``Replica`` objects, so its outstanding counts are its own requests
only; both scrape the same ``/metrics`` (queue, running, KV usage) and, for ``prefix_precise``,
receive every replica's KV events 20 ms after the step (the driver delivers each batch to
both indexes). What the instances do not share: the approximate index (``prefix``), the
pending marks of just-routed requests (``prefix_precise``), the cold-placement memory and the
smoothed loads.

``prefix_fixed_capacity`` is a diagnostic, not a shipped default: ``prefix`` with
``learn_capacity: false`` and ``kv_capacity_tokens`` set to the pool's true KV capacity. With
``learn_capacity`` (the default) each instance divides the characters *it* sent by the prompt
tokens the replica counted from *both* instances, so it learns about half the real characters
per token and sizes its index at about half the replica's cache; this row separates that
effect from the instances' disagreement about where prefixes live.

Reported per workload x strategy x setup: hit_rate (replicas' own counters), TTFT p50/p99,
imbalance (max/mean time-averaged outstanding over the pool, both instances' requests),
groups_spread (mean number of distinct replicas a prefix group, tenant or conversation, was
sent to: 1.0 = each group kept one home), and for ``two`` the ratios to ``one``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._routing_des import GatewaySpec, Job, PoolRun, SimClock, Workload
from bench.prefix_routing import (
    DEFAULT_CONVERSATIONS,
    FULL,
    QUICK,
    Scale,
    SegmentTokenizer,
    at_load,
    build_workload,
    make_router,
    summarize,
)
from bench.sim.params import SimParams, load_profile
from policies.routing import PrefixRouting
from routing.factory import balance_settings
from routing.kv_index import KVBlockIndex
from routing.prefix import ApproximatePrefixRouter
from routing.router import Router

STRATEGIES = (
    "round_robin",
    "least_loaded",
    "sglang_cache_aware",
    "prefix",
    "prefix_fixed_capacity",
    "prefix_precise",
)
WORKLOADS = ("shared_prefix", "multiturn")
SPLITS = ("random", "alternate", "sticky")


def make_split(kind: str, instances: int, seed: int) -> Callable[[Job], int]:
    """The load balancer in front of the gateway instances: request -> instance."""
    if kind == "random":
        rng = random.Random(seed)
        return lambda job: rng.randrange(instances)
    if kind == "alternate":
        turn = iter(range(1 << 62))
        return lambda job: next(turn) % instances
    if kind == "sticky":
        return lambda job: zlib.crc32(job.tenant.encode()) % instances
    raise ValueError(f"unknown split {kind}")


def make_instance(
    strategy: str, clock: SimClock, tokenizer: Callable[[str], list[int]], params: SimParams
) -> tuple[Router, KVBlockIndex | None]:
    if strategy != "prefix_fixed_capacity":
        return make_router(strategy, clock, tokenizer)
    p = PrefixRouting(learn_capacity=False, kv_capacity_tokens=params.kv_capacity_tokens)
    return ApproximatePrefixRouter(
        p.chunk_chars, p.kv_capacity_tokens, p.chars_per_token, balance_settings(p), p.min_match,
        p.learn_capacity, p.work_half_life_s, p.load_smoothing_s, clock,
    ), None  # fmt: skip


def groups_spread(jobs: list[Job], warmup_s: float) -> float:
    homes: dict[str, set[int]] = {}
    for j in jobs:
        if j.arrival >= warmup_s:
            homes.setdefault(j.group, set()).add(j.replica)
    return sum(len(h) for h in homes.values()) / len(homes) if homes else 0.0


def run_setup(
    strategy: str,
    workload: Workload,
    params: SimParams,
    replicas: int,
    scale: Scale,
    tokenizer: Callable[[str], list[int]],
    instances: int,
    split: str,
    seed: int,
) -> dict[str, Any]:
    clock = SimClock()
    built = [make_instance(strategy, clock, tokenizer, params) for _ in range(instances)]
    (router, index), more = built[0], built[1:]
    run = PoolRun(
        params, replicas, router, clock=clock, kv_index=index, warmup_s=scale.warmup_s,
        gateways=[GatewaySpec(r, i) for r, i in more], split=make_split(split, instances, seed),
    )  # fmt: skip
    t0 = time.perf_counter()
    res = run.run(workload)
    row = summarize(
        res, strategy, workload.name, replicas, scale.warmup_s, time.perf_counter() - t0
    )
    shares = [sum(1 for j in res.jobs if j.gateway == g) / len(res.jobs) for g in range(instances)]
    setup = "one" if instances == 1 else f"two/{split}"
    return {
        "setup": setup,
        **row,
        "groups_spread": round(groups_spread(res.jobs, scale.warmup_s), 3),
        "instance_shares": [round(s, 3) for s in shares],
    }


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    one = {(r["workload"], r["strategy"]): r for r in rows if r["setup"] == "one"}
    out = []
    for r in rows:
        base = one.get((r["workload"], r["strategy"]))
        if r["setup"] == "one" or base is None:
            continue
        out.append({
            "workload": r["workload"],
            "strategy": r["strategy"],
            "setup": r["setup"],
            "hit_ratio": round(r["hit_rate"] / base["hit_rate"], 3) if base["hit_rate"] else None,
            "p50_ratio": round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 3),
            "p99_ratio": round(r["ttft_p99_ms"] / base["ttft_p99_ms"], 3),
            "imbalance_delta": round(r["imbalance"] - base["imbalance"], 3),
        })  # fmt: skip
    return out


def _table(rows: list[dict[str, Any]], head: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.two_gateways", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    ap.add_argument("--strategy", default="all", help="all, or comma-separated names")
    ap.add_argument("--split", default="random", help="comma-separated: random,alternate,sticky")
    ap.add_argument("--quick", action="store_true", help="a shorter run (about a minute here)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=1.0, help="arrival-rate factor")
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--conversations", type=Path, default=DEFAULT_CONVERSATIONS)
    args = ap.parse_args(argv)
    splits = args.split.split(",")
    if any(s not in SPLITS for s in splits):
        ap.error(f"--split takes {', '.join(SPLITS)}")
    strategies = STRATEGIES if args.strategy == "all" else tuple(args.strategy.split(","))
    if any(s not in STRATEGIES for s in strategies):
        ap.error(f"--strategy takes all or {', '.join(STRATEGIES)}")
    if args.replicas < 1 or args.load <= 0:
        ap.error("--replicas and --load must be positive")
    scale = at_load(QUICK if args.quick else FULL, args.load)
    params = load_profile(args.profile, num_gpu_blocks=args.kv_blocks)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    setups = [(1, "random"), *((2, s) for s in splits)]
    tok = SegmentTokenizer()
    rows: list[dict[str, Any]] = []
    for w in workloads:
        workload = build_workload(
            w, scale, args.seed, tok, args.replicas, params, args.conversations
        )
        for s in strategies:
            for instances, split in setups:
                row = run_setup(
                    s, workload, params, args.replicas, scale, tok, instances, split, args.seed
                )
                rows.append(row)
                if args.json:
                    print(json.dumps({k: v for k, v in row.items() if k != "reasons"}), flush=True)
                else:
                    print(f"{w:13} {s:18} {row['setup']:14} hit={row['hit_rate']:.3f} "
                          f"p50={row['ttft_p50_ms']}ms p99={row['ttft_p99_ms']}ms "
                          f"imb={row['imbalance']} spread={row['groups_spread']} "
                          f"reasons={row['reasons']} wall={row['wall_s']}s",
                          file=sys.stderr, flush=True)  # fmt: skip
    ratios = _ratios(rows)
    if args.json:
        for r in ratios:
            print(json.dumps({"ratio": "two/one", **r}))
        return 0
    print(_table(rows, ("workload", "strategy", "setup", "hit_rate", "ttft_p50_ms", "ttft_p99_ms",
                        "imbalance", "groups_spread")))  # fmt: skip
    print()
    print(_table(ratios, ("workload", "strategy", "setup", "hit_ratio", "p50_ratio", "p99_ratio",
                          "imbalance_delta")))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
