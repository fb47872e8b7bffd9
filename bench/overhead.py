"""Gateway overhead, side by side: direct, the aiohttp floor, llm-gateway, LiteLLM, Portkey.

One run starts the fake upstream (fixed latency; streams of --chunks chunks --chunk-interval-ms
apart), a bare aiohttp proxy ("floor", the least a Python proxy on this stack can cost),
llm-gateway with one worker (gateway-w1) and with one per core (gateway-wN), the LiteLLM proxy
(from .venv-litellm, see bench/litellm-env.sh) with one worker and with N, and the Portkey
gateway (from .venv-portkey, bench/portkey-env.sh), all configured with the same upstream.
Single-process proxies are pinned to core 1; the load generator (this process) and the upstream
to core 0; the N-worker arms may use every core, core 0 included. Each repeat measures, targets interleaved in rotating
order: concurrency-1 latency (non-streaming and streaming), CPU per request (utime + stime of
the proxy's process tree over the requests it served), memory, added latency at a fixed rate
(skipped for a proxy that the fixed rate would saturate), and the highest open-loop rate whose
added p99 stays under --slo-ms and under --equal-p99-ms (the threshold at which gateway and
LiteLLM rates are compared: LiteLLM's own concurrency-1 overhead is far above --slo-ms).
Medians over --repeats are reported; added latency is a proxy's percentile minus the upstream's
percentile from the same repeat. With --tracing (the default) the gateway also runs twice more
with tracing on, exporting OTLP/HTTP to a span-counting receiver (bench._otlp_sink): at the
policy's default sample ratio and with every request traced; a closed-loop saturation phase
(alternating one-second rounds) gives the request rate that tracing costs.

    python -m bench.overhead [--quick] [--json] [--skip-litellm] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench import _procs
from bench._loadgen import Sample, Target
from bench._overhead_measure import (
    RateSearch,
    Stats,
    SweepSettings,
    closed_loop,
    concurrency_one,
    run_level,
    sweep,
)
from bench._overhead_report import Results, as_json, figures, figures_text, table
from bench._overhead_servers import Proxy, start_all


@dataclass(frozen=True)
class Plan:
    repeats: int
    c1_requests: int
    c1_block: int
    c1_streams: int
    fixed_s: float
    level_s: float
    min_requests: int
    retry: bool
    stream_sweep: bool
    sat_s: float


def _plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(1, 300, 50, 5, 1.5, 1.0, 60, False, False, 4.0)
    else:
        plan = Plan(3, 1500, 100, 20, 4.0, 3.0, 200, True, True, 8.0)
    repeats = args.repeats if args.repeats is not None else plan.repeats
    stream_sweep = plan.stream_sweep if args.stream_sweep is None else args.stream_sweep
    return Plan(**{**plan.__dict__, "repeats": repeats, "stream_sweep": stream_sweep})


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def _warm(proxy: Proxy) -> None:
    await concurrency_one(proxy.plain, 100 if proxy.name.startswith("litellm") else 300)
    await concurrency_one(proxy.stream, 2)


async def _concurrency_one_round(
    targets: list[Proxy], plan: Plan, results: Results, chunks: int
) -> None:
    plain: dict[str, list[Sample]] = {t.name: [] for t in targets}
    streams: dict[str, list[Sample]] = {t.name: [] for t in targets}
    cpu_plain = dict.fromkeys(plain, 0.0)
    cpu_stream = dict.fromkeys(plain, 0.0)

    async def timed(
        proxy: Proxy, target: Target, count: int, cpu: dict[str, float]
    ) -> list[Sample]:
        before = proxy.server.cpu_seconds() if proxy.server else 0.0
        samples = await concurrency_one(target, count)
        if proxy.server:
            cpu[proxy.name] += proxy.server.cpu_seconds() - before
        return samples

    for _ in range(max(1, plan.c1_requests // plan.c1_block)):
        for proxy in targets:
            plain[proxy.name] += await timed(proxy, proxy.plain, plan.c1_block, cpu_plain)
    for _ in range(plan.c1_streams):
        for proxy in targets:
            streams[proxy.name] += await timed(proxy, proxy.stream, 1, cpu_stream)

    def percentiles(name: str) -> dict[str, float]:
        ns, st = Stats.of(plain[name]), Stats.of(streams[name], min_events=chunks)
        if ns.errors or st.errors:
            _say(f"{name}: {ns.errors} failed requests, {st.errors} failed streams")
        return {"ns_c1_p50": ns.done_p50, "ns_c1_p99": ns.done_p99,
                "st_ttft_p50": st.first_p50, "st_ttft_p99": st.first_p99,
                "st_gap_p99": st.gap_p99}  # fmt: skip

    base = percentiles("direct")
    for key, value in base.items():
        results.put(key, "direct", value)
    for proxy in targets:
        if proxy.server is None:
            continue
        for key, value in percentiles(proxy.name).items():
            results.put(key, proxy.name, value - base[key])
        cpu_us = cpu_plain[proxy.name] / len(plain[proxy.name]) * 1e6
        results.put("ns_cpu", proxy.name, cpu_us)
        results.put("ns_cpu_cap", proxy.name, 1e6 / cpu_us if cpu_us > 0 else math.nan)
        results.put("st_cpu", proxy.name, cpu_stream[proxy.name] / len(streams[proxy.name]) * 1e6)


async def _saturation(targets: list[Proxy], plan: Plan, results: Results, concurrency: int) -> None:
    """Closed loop at `concurrency` in flight: completed req/s and CPU per request.

    The targets take turns in one-second rounds (plan.sat_s rounds each), so a slow stretch of
    this shared machine falls on all of them rather than on whichever ran then.
    """
    ok = dict.fromkeys((p.name for p in targets), 0)
    failed = dict.fromkeys(ok, 0)
    elapsed = dict.fromkeys(ok, 0.0)
    cpu = dict.fromkeys(ok, 0.0)
    for _ in range(max(1, round(plan.sat_s))):
        for proxy in targets:
            before = proxy.server.cpu_seconds() if proxy.server else 0.0
            began = time.perf_counter()
            samples = await closed_loop(proxy.plain, concurrency, 1.0)
            elapsed[proxy.name] += time.perf_counter() - began
            if proxy.server is not None:
                cpu[proxy.name] += proxy.server.cpu_seconds() - before
            good = sum(1 for s in samples if s.ok)
            ok[proxy.name] += good
            failed[proxy.name] += len(samples) - good
    for proxy in targets:
        name = proxy.name
        if failed[name]:
            _say(f"saturation: {name} had {failed[name]} failed requests")
        results.put("ns_sat", name, ok[name] / elapsed[name])
        if proxy.server is not None and ok[name]:
            results.put("ns_sat_cpu", name, cpu[name] / ok[name] * 1e6)


async def _tracing_export(proxies: list[Proxy]) -> dict[str, Any]:
    """What the traced gateway's OTLP receiver got, next to the requests the gateway answered."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for proxy in proxies:
            if proxy.otlp_sink_port is None or proxy.server is None:
                continue
            async with session.get(f"http://127.0.0.1:{proxy.server.port}/metrics") as resp:
                text = await resp.text()
            answered = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "llm_gateway_requests"
                for sample in family.samples
                if sample.name == "llm_gateway_requests_total"
            )
            counts: dict[str, int] = {}
            for _ in range(30):  # the batch processor exports every 5 s
                async with session.get(f"http://127.0.0.1:{proxy.otlp_sink_port}/count") as resp:
                    counts = await resp.json()
                if counts["roots"] >= answered:
                    break
                await asyncio.sleep(0.5)
            out[proxy.name] = {
                "requests_answered": answered,
                "request_spans_received": counts["roots"],
                "spans_received": counts["spans"],
                "export_posts": counts["requests"],
                "spans_per_request": counts["spans"] / answered if answered else math.nan,
            }
    return out


async def _fixed_rate(
    direct: Proxy, proxies: list[Proxy], rate: float, plan: Plan, results: Results
) -> None:
    for proxy in proxies:
        cpu_us = results.raw("ns_cpu", proxy.name)[-1]
        if cpu_us * rate / 1e6 > 0.8:  # would saturate its core: a backlog, not a latency
            _say(f"fixed rate: {proxy.name} skipped ({cpu_us:.0f} us/request x {rate:g}/s)")
            continue
        base = await run_level(direct.plain, rate, plan.fixed_s, False, 15)
        level = await run_level(proxy.plain, rate, plan.fixed_s, False, 15)
        if level.stats.errors:
            _say(f"fixed rate: {proxy.name} had {level.stats.errors} failed requests")
        results.put("ns_fixed_p50", "direct", base.stats.done_p50)
        results.put("ns_fixed_p50", proxy.name, level.stats.done_p50 - base.stats.done_p50)
        results.put("ns_fixed_p99", "direct", base.stats.done_p99)
        results.put("ns_fixed_p99", proxy.name, level.stats.done_p99 - base.stats.done_p99)


async def _sweeps(
    direct: Proxy, proxies: list[Proxy], plan: Plan, args: argparse.Namespace, results: Results
) -> None:
    thresholds = (args.slo_ms, args.equal_p99_ms)
    stream_s = args.chunks * args.chunk_interval_ms / 1000
    modes = [("ns", False, args.start_rate)]
    if plan.stream_sweep:
        modes.append(("st", True, args.start_stream_rate))
    servers = {p.name: p.server for p in proxies if p.server is not None}

    async def settle(name: str) -> None:
        waited = await servers[name].settle()
        _say(f"  {name}: settled after {waited:.1f} s")

    for prefix, stream, start in modes:
        settings = SweepSettings(
            stream=stream,
            thresholds=thresholds,
            level_s=plan.level_s,
            min_requests=plan.min_requests,
            drain_s=10 + (stream_s if stream else 0),
            retry=plan.retry,
            direct_budget_ms=args.direct_budget_ms,
        )
        searches = {p.name: RateSearch(p.name, thresholds, start, args.max_rate) for p in proxies}
        targets = {p.name: (p.stream if stream else p.plain) for p in proxies}
        _say(f"{prefix}: rate search over {', '.join(targets)}")
        log = await sweep(
            direct.stream if stream else direct.plain, targets, searches, settings, settle
        )
        for name, search in searches.items():
            steps = ", ".join(f"{r:g}:{a:+.1f}" for r, a in sorted(search.added.items()))
            _say(f"{prefix} {name}: rate:added-p99-ms {steps} (levels {len(log[name])})")
            for key, threshold in (("rate_slo", args.slo_ms), ("rate_eq", args.equal_p99_ms)):
                rate, bound = search.result(threshold)
                results.put(f"{prefix}_{key}", name, rate, bound)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = _plan(args)
    if args.pin and args.cores >= 2:
        os.sched_setaffinity(0, {0})
    else:
        args.pin = False
    servers: list[_procs.Server] = []
    started = time.time()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp_dir:
        tmp = Path(args.log_dir) if args.log_dir else Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            direct, proxies, skipped = await start_all(args, tmp, servers, _say)
            _say(f"up: {', '.join(p.name for p in proxies)}; warming")
            for proxy in [direct, *proxies]:
                await _warm(proxy)
            results = Results(["direct", *(p.name for p in proxies)])
            for proxy in proxies:
                assert proxy.server is not None
                results.put("mem_idle", proxy.name, proxy.server.memory_per_worker()[0])
            everyone = [direct, *proxies]
            for repeat in range(plan.repeats):
                shift = repeat % len(everyone)
                order = everyone[shift:] + everyone[:shift]
                _say(f"repeat {repeat + 1}/{plan.repeats}: concurrency 1 ({len(order)} targets)")
                await _concurrency_one_round(order, plan, results, args.chunks)
                order_proxies = [p for p in order if p.server is not None]
                for proxy in order_proxies:
                    assert proxy.server is not None
                    results.put("rss", proxy.name, proxy.server.memory_mib()[0])
                _say(f"repeat {repeat + 1}: saturation, {args.sat_concurrency} in flight")
                await _saturation(order, plan, results, args.sat_concurrency)
                for proxy in order_proxies:
                    assert proxy.server is not None
                    rss, _, pss = proxy.server.memory_per_worker()
                    results.put("mem_load", proxy.name, rss)
                    results.put("mem_load_pss", proxy.name, pss)
                _say(f"repeat {repeat + 1}: {args.fixed_rate:g} req/s")
                await _fixed_rate(direct, order_proxies, args.fixed_rate, plan, results)
                await _sweeps(direct, order_proxies, plan, args, results)
                for proxy in order_proxies:
                    assert proxy.server is not None
                    results.put("rss_peak", proxy.name, proxy.server.memory_mib()[1])
                    results.put("mem_peak", proxy.name, proxy.server.memory_per_worker()[1])
            exported = await _tracing_export(proxies)
        finally:
            for server in reversed(servers):
                server.stop()
    labels = {
        "fixed": f"{args.fixed_rate:g}",
        "slo": f"{args.slo_ms:g}",
        "eq": f"{args.equal_p99_ms:g}",
        "sat": f"{args.sat_concurrency}",
    }
    return {
        "benchmark": "bench.overhead",
        "command": " ".join(["python -m bench.overhead", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": _cpu_model(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "pinned": core_split(args),
        },
        "settings": {
            "upstream_latency_ms": args.upstream_latency_ms,
            "chunks": args.chunks,
            "chunk_interval_ms": args.chunk_interval_ms,
            "slo_ms": args.slo_ms,
            "equal_p99_ms": args.equal_p99_ms,
            "fixed_rate": args.fixed_rate,
            "plan": plan.__dict__,
        },
        "targets": results.targets,
        "skipped": skipped,
        "labels": labels,
        "metrics": as_json(results, labels),
        "tracing_export": exported,
        "figures": figures(results, args.cores),
        "table": table(results, labels),
        "verdict": figures_text(figures(results, args.cores), core_split(args)),
    }


def core_split(args: argparse.Namespace) -> str:
    if not args.pin:
        return "not pinned"
    return (
        f"{args.cores} cores; single-process proxies on core 1, load generator + upstream on "
        f"core 0, gateway-wN and litellm-wN ({args.cores} workers) on cores 0-{args.cores - 1}"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="one short repeat (~2 minutes)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--skip-gateway", action="store_true")
    parser.add_argument("--skip-portkey", action="store_true")
    parser.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores to use; gateway-wN and litellm-wN run this many workers (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--upstream-latency-ms", type=float, default=1.0)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-interval-ms", type=float, default=20.0)
    parser.add_argument(
        "--slo-ms", type=float, default=5.0, help="added-p99 bound of the rate search"
    )
    parser.add_argument(
        "--equal-p99-ms", type=float, default=50.0,
        help="added-p99 bound at which proxies' rates are compared (LiteLLM cannot meet --slo-ms)",
    )  # fmt: skip
    parser.add_argument(
        "--direct-budget-ms",
        type=float,
        default=10.0,
        help="rate search: stop where the upstream's own p99 drifts this far (generator limit)",
    )
    parser.add_argument("--fixed-rate", type=float, default=1000.0)
    parser.add_argument(
        "--sat-concurrency", type=int, default=16, help="requests in flight, saturation phase"
    )
    parser.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the gateway with every request traced and exported (OTLP/HTTP)",
    )
    parser.add_argument("--start-rate", type=float, default=20.0)
    parser.add_argument("--start-stream-rate", type=float, default=5.0)
    parser.add_argument("--max-rate", type=float, default=20000.0)
    parser.add_argument(
        "--stream-sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="search the streaming rate too (default: on, off with --quick)",
    )
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    args = parser.parse_args(argv)
    # SIGTERM (a timeout, a CI runner) unwinds like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    report = uvloop.run(run(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"\n{report['command']}  ({report['started']}, {report['duration_s']} s)")
        for name, why in report["skipped"].items():
            print(f"skipped {name}: {why.splitlines()[0]}")
        print(report["table"])
        print(report["verdict"])
        for name, seen in report["tracing_export"].items():
            answered = seen["requests_answered"]
            print(
                f"{name}: {seen['request_spans_received']:,} request spans received for "
                f"{answered:,.0f} requests answered "
                f"({seen['request_spans_received'] / max(answered, 1):.1%} traced, "
                f"{seen['spans_received']:,} spans in all)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
