"""Prefix-aware routing, side by side: ``python -m bench.prefix_routing [--quick] [--json]``.

Every strategy replays the same arrivals against the same simulated pool (N replicas of the
simulator's vLLM engine, bench/_routing_des.py, virtual time). Reported per strategy x workload:
- hit_rate: prefix-cache hits / queries in tokens, from the replicas' own counters
  (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``), after the warm-up;
- ttft p50/p90/p99 (ms, simulated): arrival to first token of requests after the warm-up;
- throughput: output tokens per simulated second over the whole run;
- imbalance: max over replicas of its time-averaged outstanding requests / the mean over
  replicas (1.0 = perfectly even), over the arrival window after the warm-up;
- route_us: real CPU per routing decision on this machine (not part of simulated time);
- ttft_p50_floor_ms / ttft_p99_floor_ms: the same percentiles of each request's TTFT floor
  (bench/_ttft_bound.py: unbounded cache holding the request's conversation or tenant context
  on its replica, no queueing), below which no routing strategy can go on this run.

Workloads (seeded; ``--seed``):
- shared_prefix: 72 tenants, each with its own system prompt of 1.5-4k tokens, short
  questions (30-120 tokens), Zipf(0.3) tenant popularity, Poisson arrivals (40/s for 4
  replicas, scaled with --replicas), 32-160 output tokens.
- multiturn: conversations from the evaluation data's workloads/sharegpt_multiturn_dev.jsonl (or
  ``--conversations FILE``, same format), started as a Poisson process and replayed turn by
  turn: each request carries the conversation so far, with the simulated model's own earlier
  replies (so, as in production, they are in the replica's cache); the next turn comes after
  an exponential think time (mean 2 s); output length = the recorded reply's, capped at 200.
  9 conversation starts/s for 4 replicas.
- no_reuse: unique prompts (0.5-2.5k tokens), Poisson arrivals (30/s for 4 replicas): no
  prefix can help.
--quick simulates 24 s (8 s warm-up) of each, the full run 120 s (20 s warm-up).
``--load 1,1.5,2`` multiplies every workload's arrival rate (requests/s, conversation starts/s)
by each factor in turn, over the same simulated duration; a multiturn load that needs more
conversations than the file holds replays it again, each copy's first message tagged so that
copies share no prefix. Beside the figures above, each row states whether the pool kept up:
served_frac = the fraction of requests arrived in the window [warm-up, last arrival of the
workload] whose first token came inside it (about 1.0 when stable, lower when a queue builds),
and waiting_mid / waiting_end = requests queued in the engines halfway through the window and
when it closed (a queue that grows from one to the other is a pool that does not keep up).
TTFTs count requests arrived inside that window (multiturn turns that arrive after it, while
conversations wind down at a falling load, are not measured).

The pool: the ``h100-llama3-8b`` simulator profile's timings with a KV cache of
``--kv-blocks`` blocks of 16 tokens per replica (default 4096 = 65,536 tokens, about one sixth
of an 8B model's cache on a full H100: the size of cache a larger model leaves per GPU) so the
workloads' working sets exceed one replica's cache, which is when routing decides hit rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._routing_des import Job, PoolRun, RunResult, SimClock, Workload, percentile
from bench._ttft_bound import ttft_floors
from bench.data import data_file, require
from bench.sim.params import SimParams, load_profile
from bench.sim.tokenizer import SPECIAL_TOKENS, detokenize
from bench.sim.tokenizer import tokenize as sim_tokenize
from policies.routing import PrecisePrefixRouting, PrefixRouting, SessionRouting
from routing.factory import balance_settings
from routing.kv_index import CallableTokenizer, KVBlockIndex
from routing.least_loaded import LeastLoadedRouter, RoundRobinRouter
from routing.prefix import ApproximatePrefixRouter, PrefixAwareRouter
from routing.prompt_text import render_chat
from routing.replica import Replica
from routing.router import Router, RoutingDecision, RoutingRequest
from routing.session import SessionRouter
from routing.sglang_cache_aware import SGLangCacheAwareRouter

DEFAULT_CONVERSATIONS = data_file("workloads/sharegpt_multiturn_dev.jsonl")
STRATEGIES = (
    "round_robin",
    "least_loaded",
    "session",
    "sglang_cache_aware",
    "prefix",
    "prefix_precise",
)
WORKLOADS = ("shared_prefix", "multiturn", "no_reuse")
_SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class SegmentTokenizer:
    """The simulator's tokenizer, memoized per segment between special tokens.

    The stand-in tokenizer never merges across a special token, so tokenizing each segment
    and concatenating gives exactly ``bench.sim.tokenizer.tokenize(text)``; memoizing the
    segments (system prompts, earlier turns) makes re-tokenizing growing prompts cheap.
    """

    def __init__(self) -> None:
        self._memo: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        out: list[int] = []
        for part in _SPECIAL.split(text):
            if not part:
                continue
            ids = self._memo.get(part)
            if ids is None:
                ids = self._memo[part] = sim_tokenize(part)
            out.extend(ids)
        return out


def _vocabulary(size: int = 20_000) -> list[str]:
    rng = random.Random(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(size)]


_VOCAB = _vocabulary()


def _words(rng: random.Random, tokens: int) -> str:
    """Random words, about ``tokens`` stand-in tokens (4.5 characters per token)."""
    return " ".join(rng.choices(_VOCAB, k=max(1, round(tokens * 0.75))))


@dataclass(frozen=True)
class Scale:
    duration_s: float
    tenants: int
    rate: float  # shared_prefix requests/s
    zipf: float  # tenant popularity exponent
    conversations: int
    conv_rate: float  # multiturn conversation starts/s
    no_reuse_rate: float
    warmup_s: float


QUICK = Scale(
    duration_s=24.0, tenants=72, rate=40.0, zipf=0.3, conversations=220, conv_rate=9.0,
    no_reuse_rate=30.0, warmup_s=8.0,
)  # fmt: skip
FULL = Scale(
    duration_s=120.0, tenants=72, rate=40.0, zipf=0.3, conversations=1100, conv_rate=9.0,
    no_reuse_rate=30.0, warmup_s=20.0,
)  # fmt: skip


def at_load(scale: Scale, load: float) -> Scale:
    """The same workloads over the same duration with every arrival rate times ``load``."""
    return dataclasses.replace(
        scale,
        rate=scale.rate * load,
        conv_rate=scale.conv_rate * load,
        no_reuse_rate=scale.no_reuse_rate * load,
        conversations=math.ceil(scale.conversations * load),
    )


class SharedPrefix:
    name = "shared_prefix"

    def __init__(self, scale: Scale, seed: int, tok: SegmentTokenizer, replicas: int) -> None:
        rng = random.Random(seed)
        rate = scale.rate * replicas / 4
        prompts = [_words(rng, rng.randint(1500, 4000)) for _ in range(scale.tenants)]
        weights = [1 / (k + 1) ** scale.zipf for k in range(scale.tenants)]
        self.jobs: list[tuple[float, int, str, int]] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > scale.duration_s:
                break
            tenant = rng.choices(range(scale.tenants), weights)[0]
            self.jobs.append((t, tenant, _words(rng, rng.randint(30, 120)), rng.randint(32, 160)))
        self.prompts = prompts
        self.tok = tok

    def initial(self) -> list[Job]:
        out = []
        for t, tenant, question, max_tokens in self.jobs:
            messages = [
                {"role": "system", "content": self.prompts[tenant]},
                {"role": "user", "content": question},
            ]
            text = render_chat(messages)
            out.append(
                Job(t, text, self.tok(text), max_tokens, f"tenant-{tenant}", group=str(tenant))
            )
        return out

    def follow_up(self, job: Job, now: float) -> Job | None:
        return None


class NoReuse:
    name = "no_reuse"

    def __init__(self, scale: Scale, seed: int, tok: SegmentTokenizer, replicas: int) -> None:
        rng = random.Random(seed + 2)
        rate = scale.no_reuse_rate * replicas / 4
        self.jobs: list[Job] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > scale.duration_s:
                break
            text = render_chat([{"role": "user", "content": _words(rng, rng.randint(500, 2500))}])
            n = len(self.jobs)
            self.jobs.append(Job(t, text, tok(text), rng.randint(32, 160), f"u{n}", group=f"{n}"))

    def initial(self) -> list[Job]:
        return [Job(j.arrival, j.text, j.tokens, j.max_tokens, j.tenant, group=j.group)
                for j in self.jobs]  # fmt: skip

    def follow_up(self, job: Job, now: float) -> Job | None:
        return None


@dataclass
class _Conversation:
    cid: str
    users: list[str]
    reply_tokens: list[int]
    rng: random.Random
    history: list[dict[str, str]]
    turn: int = 0


class MultiTurn:
    name = "multiturn"
    think_mean_s = 2.0
    max_reply = 200

    def __init__(
        self,
        scale: Scale,
        seed: int,
        tok: SegmentTokenizer,
        replicas: int,
        path: Path,
        max_model_len: int,
    ) -> None:
        rng = random.Random(seed + 1)
        self.tok = tok
        self.max_model_len = max_model_len
        self.rate = scale.conv_rate * replicas / 4
        self.rows: list[tuple[str, list[str], list[int]]] = []
        want = scale.conversations * replicas // 4
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                msgs = row["messages"]
                users = [m["content"] for m in msgs if m["role"] == "user"]
                replies = [m["content"] for m in msgs if m["role"] == "assistant"]
                lens = [max(16, min(self.max_reply, len(sim_tokenize(r)))) for r in replies]
                lens += [self.max_reply] * (len(users) - len(lens))
                self.rows.append((str(row["id"]), users, lens))
                if len(self.rows) >= want:
                    break
        originals = len(self.rows)
        for k in range(originals, want if originals else 0):
            cid, users, lens = self.rows[k % originals]
            copy = k // originals
            self.rows.append((f"{cid}#{copy}", [f"[copy {copy}] {users[0]}", *users[1:]], lens))
        self.starts = []
        t = 0.0
        for _ in self.rows:
            t += rng.expovariate(self.rate)
            self.starts.append(t)
        self.seed = seed

    def _job(self, conv: _Conversation, arrival: float) -> Job | None:
        if conv.turn >= len(conv.users):
            return None
        messages = [*conv.history, {"role": "user", "content": conv.users[conv.turn]}]
        text = render_chat(messages)
        tokens = self.tok(text)
        max_tokens = conv.reply_tokens[conv.turn]
        if len(tokens) + max_tokens > self.max_model_len:
            return None
        return Job(arrival, text, tokens, max_tokens, f"user-{conv.cid}", conv.cid, conv.cid, conv)

    def initial(self) -> list[Job]:
        out = []
        for i, ((cid, users, lens), start) in enumerate(zip(self.rows, self.starts, strict=True)):
            conv = _Conversation(cid, users, lens, random.Random(self.seed * 7919 + i), [])
            job = self._job(conv, start)
            if job is not None:
                out.append(job)
        return out

    def follow_up(self, job: Job, now: float) -> Job | None:
        conv = job.key
        assert isinstance(conv, _Conversation)
        conv.history.append({"role": "user", "content": conv.users[conv.turn]})
        conv.history.append({"role": "assistant", "content": detokenize(job.output)})
        conv.turn += 1
        return self._job(conv, now + conv.rng.expovariate(1 / self.think_mean_s))


class GroupOracle:
    """Reference only: each prefix group (tenant, conversation) pinned to one replica, groups
    dealt out evenly in order of appearance; it knows the groups, which a router does not."""

    def __init__(self) -> None:
        self._home: dict[str, int] = {}

    def choose(self, replicas: list[Replica], request: RoutingRequest) -> RoutingDecision | None:
        key = request.session_key or request.tenant
        i = self._home.setdefault(key, len(self._home) % len(replicas))
        return RoutingDecision(replicas[i], "oracle")


def make_router(
    strategy: str, clock: SimClock, tokenizer: Callable[[str], list[int]]
) -> tuple[Router, KVBlockIndex | None]:
    if strategy == "round_robin":
        return RoundRobinRouter(), None
    if strategy == "least_loaded":
        return LeastLoadedRouter(), None
    if strategy == "session":
        s = SessionRouting()
        return SessionRouter(s.virtual_nodes, s.prefix_chars, s.bounded_load_epsilon), None
    if strategy == "sglang_cache_aware":
        return SGLangCacheAwareRouter(clock=clock), None
    if strategy == "prefix":
        p = PrefixRouting()
        router = ApproximatePrefixRouter(
            p.chunk_chars, p.kv_capacity_tokens, p.chars_per_token, balance_settings(p),
            p.min_match, p.learn_capacity, p.work_half_life_s, p.load_smoothing_s, clock,
        )  # fmt: skip
        return router, None
    if strategy == "prefix_precise":
        q = PrecisePrefixRouting()
        index = KVBlockIndex(
            CallableTokenizer(tokenizer), q.block_size, q.pending_ttl_s, clock=clock
        )
        precise = PrefixAwareRouter(
            index, balance_settings(q), q.min_match, q.work_half_life_s, q.load_smoothing_s, clock
        )
        return precise, index
    if strategy == "oracle":
        return GroupOracle(), None  # type: ignore[return-value]
    raise ValueError(f"unknown strategy {strategy}")


def run_one(
    strategy: str, workload: Workload, params: SimParams, replicas: int, scale: Scale,
    tokenizer: Callable[[str], list[int]],
) -> dict[str, Any]:  # fmt: skip
    clock = SimClock()
    router, index = make_router(strategy, clock, tokenizer)
    run = PoolRun(params, replicas, router, clock=clock, kv_index=index, warmup_s=scale.warmup_s)
    t0 = time.perf_counter()
    res = run.run(workload)
    wall = time.perf_counter() - t0
    return summarize(res, strategy, workload.name, replicas, scale.warmup_s, wall, params)


def summarize(
    res: RunResult, strategy: str, workload: str, replicas: int, warmup_s: float, wall: float,
    params: SimParams | None = None,
) -> dict[str, Any]:  # fmt: skip
    measured = [j for j in res.jobs if warmup_s <= j.arrival <= res.window_end]
    ttft = [(j.first_token_at or 0) - j.arrival for j in measured if j.first_token_at]
    floor: dict[str, float] = {}
    if params is not None:  # the TTFT no router could beat on these requests (_ttft_bound)
        floors = ttft_floors(res.jobs, params)
        mine = [floors[id(j)] for j in measured]
        floor = {f"ttft_{q}_floor_ms": round(percentile(mine, v) * 1000, 1)
                 for q, v in (("p50", 0.50), ("p99", 0.99))}  # fmt: skip
    served = sum(1 for j in measured if (j.first_token_at or math.inf) <= res.window_end)
    out_tokens = sum(len(j.output) for j in res.jobs)
    return {
        "strategy": strategy,
        "workload": workload,
        "replicas": replicas,
        "requests": len(res.jobs),
        "hit_rate": round(res.hits / res.queries, 4) if res.queries else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 0.50) * 1000, 1),
        "ttft_p90_ms": round(percentile(ttft, 0.90) * 1000, 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99) * 1000, 1),
        **floor,
        "throughput_tok_s": round(out_tokens / res.makespan, 1) if res.makespan else 0.0,
        "imbalance": round(res.imbalance, 3),
        "route_us": round(res.route_us, 1),
        "preemptions": res.preemptions,
        "served_frac": round(served / len(measured), 4) if measured else 1.0,
        "waiting_mid": res.waiting_at_mid,
        "waiting_end": res.waiting_at_end,
        "reasons": res.reasons,
        "wall_s": round(wall, 2),
    }


def build_workload(
    name: str, scale: Scale, seed: int, tok: SegmentTokenizer, replicas: int,
    params: SimParams, conversations: Path,
) -> Workload:  # fmt: skip
    if name == "shared_prefix":
        return SharedPrefix(scale, seed, tok, replicas)
    if name == "no_reuse":
        return NoReuse(scale, seed, tok, replicas)
    if name == "multiturn":
        return MultiTurn(scale, seed, tok, replicas, require(conversations), params.max_model_len)
    raise ValueError(f"unknown workload {name}")


def _table(rows: list[dict[str, Any]]) -> str:
    head: tuple[str, ...] = ("workload", "strategy", "hit_rate", "ttft_p50_ms", "ttft_p90_ms",
                             "ttft_p99_ms", "ttft_p99_floor_ms", "throughput_tok_s", "imbalance",
                             "route_us")  # fmt: skip
    if any(r["load"] != 1.0 for r in rows):
        head = ("load", *head[:-1], "served_frac", "waiting_mid", "waiting_end")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]) for h in head) + " |")
    return "\n".join(lines)


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    by = {(r["load"], r["workload"], r["strategy"]): r for r in rows}
    for load, w in sorted({(r["load"], r["workload"]) for r in rows},
                          key=lambda lw: (lw[0], WORKLOADS.index(lw[1]))):  # fmt: skip
        rr, ll = by.get((load, w, "round_robin")), by.get((load, w, "least_loaded"))
        sg = by.get((load, w, "sglang_cache_aware"))
        for ours in ("prefix", "prefix_precise"):
            o = by.get((load, w, ours))
            if o is None:
                continue
            parts = [f"{w} {ours}:" if load == 1.0 else f"{w} x{load:g} {ours}:"]
            if rr and rr["hit_rate"]:
                parts.append(f"hit x{o['hit_rate'] / rr['hit_rate']:.2f} vs round_robin")
            if sg:
                parts.append(f"hit {o['hit_rate']:.3f} vs sglang {sg['hit_rate']:.3f}")
            if rr and rr["ttft_p99_ms"]:
                parts.append(f"p99 x{o['ttft_p99_ms'] / rr['ttft_p99_ms']:.2f} of round_robin")
                floor = o.get("ttft_p99_floor_ms")
                if floor is not None:  # the best ratio any router could show here
                    parts.append(f"(floor x{floor / rr['ttft_p99_ms']:.2f})")
            if ll and ll["ttft_p50_ms"]:
                parts.append(
                    f"p50/p99 x{o['ttft_p50_ms'] / ll['ttft_p50_ms']:.3f}"
                    f"/x{o['ttft_p99_ms'] / max(ll['ttft_p99_ms'], 1e-9):.3f} of least_loaded"
                )
            parts.append(f"imbalance {o['imbalance']}")
            out.append(" ".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_routing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    ap.add_argument("--strategy", choices=(*STRATEGIES, "oracle", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="a shorter run (under a minute here)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--conversations", type=Path, default=DEFAULT_CONVERSATIONS)
    ap.add_argument("--oracle", action="store_true", help="also run the group oracle")
    ap.add_argument("--zipf", type=float, default=None, help="shared_prefix tenant skew")
    ap.add_argument("--load", default="1", help="arrival-rate factors, comma-separated: 1,2")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be >= 1")
    try:
        loads = [float(x) for x in args.load.split(",")]
    except ValueError:
        ap.error("--load takes numbers separated by commas")
    if not loads or min(loads) <= 0:
        ap.error("--load factors must be positive")
    scale = QUICK if args.quick else FULL
    if args.zipf is not None:
        scale = dataclasses.replace(scale, zipf=args.zipf)
    params = load_profile(args.profile, num_gpu_blocks=args.kv_blocks)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    strategies = list(STRATEGIES) if args.strategy == "all" else [args.strategy]
    if args.oracle and "oracle" not in strategies:
        strategies.append("oracle")
    tok = SegmentTokenizer()
    rows: list[dict[str, Any]] = []
    for load, w in ((load, w) for load in loads for w in workloads):
        at = at_load(scale, load)
        workload = build_workload(w, at, args.seed, tok, args.replicas, params, args.conversations)
        for s in strategies:
            row = {"load": load, **run_one(s, workload, params, args.replicas, at, tok)}
            rows.append(row)
            if args.json:
                keys = ("strategy", "workload", "hit_rate", "ttft_p50_ms", "ttft_p99_ms",
                        "imbalance", "ttft_p90_ms", "ttft_p50_floor_ms", "ttft_p99_floor_ms",
                        "throughput_tok_s", "route_us", "replicas",
                        "requests", "load", "served_frac", "waiting_mid", "waiting_end",
                        "preemptions")  # fmt: skip
                print(json.dumps({k: row[k] for k in keys}), flush=True)
            else:
                print(f"x{load:<4g} {w:13} {s:18} hit={row['hit_rate']:.3f} "
                      f"p50={row['ttft_p50_ms']}ms p99={row['ttft_p99_ms']}ms "
                      f"(floor {row['ttft_p99_floor_ms']}ms) "
                      f"imb={row['imbalance']} served={row['served_frac']} "
                      f"waiting={row['waiting_mid']}->{row['waiting_end']} "
                      f"reasons={row['reasons']} "
                      f"wall={row['wall_s']}s", file=sys.stderr, flush=True)  # fmt: skip
    if not args.json:
        print(_table(rows))
        print()
        print("\n".join(_ratios(rows)))
    return 0 if all(math.isfinite(r["hit_rate"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
