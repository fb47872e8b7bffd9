"""Latency budgets, measured on the real gateway: ``python -m bench.budgets [--quick] [--json]``.

The gateway runs in this process (``gateway.app.create_app`` with a policy text, as the tests
do) in front of simulated vLLM replicas (``bench.sim.SimCluster``); streaming clients call
``/v1/completions`` with ``X-Surface`` headers. Everything the arms compare is the gateway's
own behaviour under two policies; only the policy text differs between arms.

Scenario ``priority`` (arms ``fifo``, ``policy``): 4 replicas of the h100-llama3-8b profile with
``max_num_seqs`` 8 (a pool that can run 32 sequences); surface ``background`` keeps 64
requests in flight (closed loop: 400-token prompts, 64-448 output tokens), surface
``interactive`` arrives open loop (Poisson, 4/s, 400-token prompts, 16-48 output tokens) with
a TTFT budget of 500 ms. ``fifo``: no gateway admission (vLLM queues first come, first served).
``policy``: priority admission, ``max_outstanding_per_replica`` 8, so the queue forms in the
gateway, in priority order. vLLM priority scheduling is off in the simulator: the gateway's
own admission must carry the result.

Scenario ``slow_replica`` (arms ``no_hedge``, ``hedge_only``, ``budget_routing``, ``hedge``): 4
replicas of h100-llama3-8b, one of them running 5x slower (its whole timeline stretched);
surface ``interactive`` (Poisson, 20/s, 1000-token prompts, 32-96 output tokens, TTFT budget
500 ms at p99), routed ``least_loaded`` (the default). ``no_hedge`` is the plain default
surface; ``hedge_only`` turns on hedging (``delay_ms: auto``, ``max_fraction: 0.1``);
``budget_routing`` turns on budget-aware replica choice alone; ``hedge`` is what a
latency-sensitive surface would run: both (``--quick`` leaves ``budget_routing`` out to stay
within 60 s). Extra upstream load = requests the replicas
received / requests clients sent - 1. Diagnostics per arm: the share of upstream requests the
slow replica received, the share of requests hedged, the share of those the hedge won, and
the hedged requests' TTFT p50. A run ends once every request of the window has a first token
(or after the drain): only TTFTs are measured here.

Reported TTFTs are simulated milliseconds (wall / ``time_scale``), percentiles over the
requests that started in the measurement window and got a first token; attainment counts the
others (errors, 503 from admission, cut off after the drain) as misses; background
throughput counts requests completed within the window, per simulated second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any

from bench._budget_load import (
    Recorder,
    Sample,
    new_session,
    percentile,
    poisson,
    prompt,
    running_gateway,
    stream_one,
    surface_stats,
)
from bench.sim.cluster import SimCluster
from bench.sim.params import SimParams, load_profile
from policies.schema import Policy
from policies.surfaces import Surface

TTFT_BUDGET_MS = 500.0
SCENARIOS = {
    "priority": ("fifo", "policy"),
    "slow_replica": ("no_hedge", "hedge_only", "budget_routing", "hedge"),
}
FULL_ONLY = {"budget_routing"}  # left out of --quick, which must finish within 60 s


@dataclass(frozen=True, slots=True)
class Timing:
    warmup_s: float  # simulated
    measure_s: float
    drain_s: float
    time_scale: float


def wired() -> bool:
    """Does the gateway's policy schema carry the budgets work (priority, actions, admission)?"""
    return "actions" in Surface.model_fields and "admission" in Policy.model_fields


def policy_text(
    urls: list[str], surfaces: dict[str, dict[str, Any]], admission: dict[str, Any] | None
) -> str:
    doc: dict[str, Any] = {
        "backends": {
            "sim": {
                "kind": "vllm",
                "replicas": urls,
                "health": {"interval_s": 60},
                "timeouts": {"first_byte_s": 600, "idle_s": 600, "total_s": 900},
            }
        },
        "models": {"sim-llama": {"backend": "sim"}},
        "surfaces": surfaces,
    }
    if admission is not None:
        doc["admission"] = admission
    return json.dumps(doc)  # JSON is YAML


def _surface(header: str, budget: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {"match": {"header": header}, "budget": budget, **(extra if wired() else {})}


# --- scenario: priority --------------------------------------------------------------------


def priority_params() -> SimParams:
    return load_profile("h100-llama3-8b", max_num_seqs=8, name="h100-llama3-8b-seqs8")


async def run_priority(arm: str, t: Timing, seed: int) -> list[dict[str, Any]]:
    ts = t.time_scale
    admit = arm == "policy"
    surfaces = {
        "interactive": _surface(
            "interactive",
            {"ttft_ms": TTFT_BUDGET_MS * ts, "percentile": "p95"},
            {"priority": "interactive", "actions": {"admission": admit}},
        ),
        "background": _surface(
            "background", {}, {"priority": "background", "actions": {"admission": admit}}
        ),
    }
    admission = (
        {"max_outstanding_per_replica": 8, "max_waiting": None, "queue_timeout_s": 600}
        if admit and wired()
        else None
    )
    async with SimCluster(4, priority_params(), time_scale=ts) as cluster:
        text = policy_text(cluster.base_urls, surfaces, admission)
        rec = Recorder()
        # Separate streams of randomness, so both arms see the same arrivals and requests.
        arrivals, ri, rb = (random.Random(f"{seed}/{k}") for k in ("arrivals", "i", "b"))

        def interactive() -> Coroutine[Any, Any, None]:
            text, n = prompt(ri, 400), ri.randint(16, 48)
            return stream_one(session, root, "interactive", text, n, rec)

        def background() -> Coroutine[Any, Any, None]:
            text, n = prompt(rb, 400), rb.randint(64, 448)
            return stream_one(session, root, "background", text, n, rec)

        async with running_gateway(text) as root, new_session() as session:
            window = await _drive(t, arrivals, [(4.0, interactive)], [(64, background)])
        rows = []
        for surface, budget in (("interactive", TTFT_BUDGET_MS), ("background", None)):
            stats = surface_stats(rec.samples, surface, window, ts, budget)
            rows.append({"scenario": "priority", "arm": arm, **asdict(stats)})
        rows[0]["max_lag_ms"] = round(cluster.max_lag_s() * 1000, 1)
        return rows


# --- scenario: slow_replica ----------------------------------------------------------------


async def run_slow_replica(arm: str, t: Timing, seed: int) -> list[dict[str, Any]]:
    ts = t.time_scale
    hedge = {"enabled": arm in ("hedge", "hedge_only"), "delay_ms": "auto", "max_fraction": 0.1}
    actions = {"hedge": hedge, "budget_routing": arm in ("hedge", "budget_routing")}
    surfaces = {
        "interactive": _surface(
            "interactive",
            {"ttft_ms": TTFT_BUDGET_MS * ts, "percentile": "p99"},
            {"priority": "interactive", "actions": actions},
        )
    }
    params = load_profile("h100-llama3-8b")
    async with (
        SimCluster(3, params, time_scale=ts) as fast,
        SimCluster(1, params, time_scale=ts * 5) as slow,
    ):
        text = policy_text(fast.base_urls + slow.base_urls, surfaces, None)
        rec = Recorder()
        arrivals, ri = (random.Random(f"{seed}/{k}") for k in ("arrivals", "i"))

        def interactive() -> Coroutine[Any, Any, None]:
            text, n = prompt(ri, 1000), ri.randint(32, 96)
            return stream_one(session, root, "interactive", text, n, rec)

        async with running_gateway(text) as root, new_session() as session:
            window = await _drive(
                t, arrivals, [(20.0, interactive)], [], settled=lambda: rec.awaiting_first == 0
            )
        received = [
            e.counters.request_success + e.counters.num_aborted + e.num_running + e.num_waiting
            for e in (r.engine for r in fast.replicas + slow.replicas)
        ]
        upstream = sum(received)
        stats = surface_stats(rec.samples, "interactive", window, ts, TTFT_BUDGET_MS)
        row: dict[str, Any] = {"scenario": "slow_replica", "arm": arm, **asdict(stats)}
        row["extra_upstream"] = round(upstream / rec.sent - 1.0, 4) if rec.sent else None
        row["slow_replica_share"] = round(received[-1] / max(upstream, 1), 4)
        row.update(hedge_stats(rec.samples, window, ts))
        row["max_lag_ms"] = round(max(fast.max_lag_s(), slow.max_lag_s() / 5) * 1000, 1)
        return [row]


def hedge_stats(
    samples: list[Sample], window: tuple[float, float], time_scale: float
) -> dict[str, Any]:
    """How many of the window's requests were hedged, how many hedges won, how fast they were."""
    mine = [s for s in samples if window[0] <= s.started < window[1]]
    hedged = [s for s in mine if s.hedge is not None]
    ttfts = [s.ttft_s * 1000 / time_scale for s in hedged if s.ttft_s is not None]
    p50 = percentile(ttfts, 0.5)
    return {
        "hedged": round(len(hedged) / len(mine), 4) if mine else None,
        "hedge_won": round(sum(s.hedge == "hedge" for s in hedged) / len(hedged), 4)
        if hedged
        else None,
        "hedged_ttft_p50_ms": None if p50 is None else round(p50, 1),
    }


# --- driving -------------------------------------------------------------------------------

Send = Callable[[], Coroutine[Any, Any, None]]


async def _drive(
    t: Timing,
    rng: random.Random,
    open_loops: list[tuple[float, Send]],
    closed_loops: list[tuple[int, Send]],
    settled: Callable[[], bool] = lambda: False,
) -> tuple[float, float]:
    """Run the load; returns the measurement window (wall, loop clock). The drain ends when
    every open-loop request has ended, when ``settled()`` says nothing more is measured, or
    after ``drain_s``."""
    loop = asyncio.get_running_loop()
    ts = t.time_scale
    t0 = loop.time()
    start = t0 + t.warmup_s * ts
    end = start + t.measure_s * ts
    stop = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    def spawn(send: Send) -> asyncio.Task[None]:
        task = asyncio.create_task(send())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def worker(send: Send) -> None:
        while not stop.is_set():
            await send()

    workers = [
        asyncio.create_task(worker(send)) for count, send in closed_loops for _ in range(count)
    ]
    arrivals = [
        asyncio.create_task(poisson(rate, ts, end, rng, lambda s=send: spawn(s)))  # type: ignore[misc]
        for rate, send in open_loops
    ]
    await asyncio.gather(*arrivals)
    # Let open-loop requests of the window finish under the same background load.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(t.drain_s * ts):
            while tasks and not settled():
                await asyncio.wait(set(tasks), timeout=0.05 * ts)
    stop.set()
    for task in [*workers, *tasks]:
        task.cancel()
    await asyncio.gather(*workers, *tasks, return_exceptions=True)
    return start, end


async def run(
    scenarios: list[str], quick: bool, time_scale: float, seed: int
) -> list[dict[str, Any]]:
    t = Timing(
        warmup_s=2.0 if quick else 5.0,
        measure_s=7.0 if quick else 60.0,
        drain_s=3.0 if quick else 10.0,
        time_scale=time_scale,
    )
    rows: list[dict[str, Any]] = []
    for scenario in scenarios:
        for arm in SCENARIOS[scenario]:
            if quick and arm in FULL_ONLY:
                continue
            if arm not in ("fifo", "no_hedge") and not wired():
                print(f"# {scenario}/{arm}: skipped, the gateway is not wired yet", file=sys.stderr)
                continue
            runner = run_priority if scenario == "priority" else run_slow_replica
            rows.extend(await runner(arm, t, seed))
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) and abs(v) < 10 else str(v)


def report(rows: list[dict[str, Any]]) -> str:
    cols = [
        "scenario",
        "arm",
        "surface",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "attainment",
        "requests",
        "errors",
        "throughput_rps",
        "extra_upstream",
        "hedged",
        "slow_replica_share",
    ]
    lines = [" ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        lines.append(" ".join(f"{_fmt(r.get(c)):>14}" for c in cols))
    lines.extend(_ratios(rows))
    return "\n".join(lines)


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["scenario"], r["arm"], r["surface"]): r for r in rows}
    out: list[str] = []
    fifo, pol = (
        by.get(("priority", "fifo", "interactive")),
        by.get(("priority", "policy", "interactive")),
    )
    if fifo and pol and fifo["ttft_p95_ms"] and pol["ttft_p95_ms"]:
        out.append(
            f"priority: interactive p95 fifo/policy = {fifo['ttft_p95_ms'] / pol['ttft_p95_ms']:.1f}x"
        )
        bf, bp = by[("priority", "fifo", "background")], by[("priority", "policy", "background")]
        if bf["throughput_rps"]:
            out.append(
                f"priority: background throughput policy/fifo = "
                f"{bp['throughput_rps'] / bf['throughput_rps']:.2f}"
            )
    nh = by.get(("slow_replica", "no_hedge", "interactive"))
    for arm in SCENARIOS["slow_replica"][1:]:
        other = by.get(("slow_replica", arm, "interactive"))
        if nh and other and nh["ttft_p99_ms"] and other["ttft_p99_ms"]:
            out.append(
                f"slow_replica: p99 no_hedge/{arm} = "
                f"{nh['ttft_p99_ms'] / other['ttft_p99_ms']:.1f}x "
                f"for {other['extra_upstream']:.1%} extra upstream requests"
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.budgets", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs (within 60 s)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    p.add_argument("--time-scale", type=float, default=1.0, help="real s per simulated s")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    try:
        import uvloop

        runner: contextlib.AbstractContextManager[asyncio.Runner] = asyncio.Runner(
            loop_factory=uvloop.new_event_loop
        )
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    scenarios = args.scenario or list(SCENARIOS)
    # A cancelled stream at the end of a run is expected; the servers need not log it.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with runner as r:
        rows = r.run(run(scenarios, args.quick, args.time_scale, args.seed))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(report(rows))


if __name__ == "__main__":
    main()
