"""Hostile clients against a real gateway process: what a well-behaved client feels, and a fuzz run.

    python -m bench.attacks                      # every attack, then a 6,000-request fuzz run
    python -m bench.attacks --only fuzz --fuzz-count 5000 --json

Set-up: bench.fake_upstream (one process, the upstream) and, for each attack, a fresh
`python -m gateway.cli serve` process in front of it, started with a 1,024 open-file limit (a
common default) and a policy with one tenant and an exact cache on the default surface.
Everything is on loopback and bounded in count and time.

For each connection attack (slowloris, slowbody, idle, gzip bomb, gzip bomb with a forged size;
see bench/_attack_conns.py):
a well-behaved client's p50/p99 over `--seconds` at `--rate` requests a second, before the
attack and during it (goal: p99 during within 2x of before), failed requests, the gateway's
resident memory (before, peak during) and open file descriptors, and what the attack's own
connections saw (closed by the server or held). The fuzz run (bench/_attack_fuzz.py) sends
`--fuzz-count` hostile requests at `--fuzz-concurrency` and counts by category: answers by
status, 5xx that are the gateway's own (a 500, or a 5xx without an OpenAI error body; goal 0),
5xx attributed to the upstream (502/503/504 with an upstream error type), answers that are
not OpenAI-shaped JSON, requests with no answer; then `/metrics` is scraped (status, size,
time), a good request is sent, and the gateway's log is searched for tracebacks and for the
fuzz's key marker (a key in a log line is a leak).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _procs
from bench._attack_conns import (
    AttackStats,
    Sampler,
    bomb_senders,
    good_request,
    gzip_bomb,
    hold_connections,
    well_behaved,
)
from bench._attack_fuzz import CATEGORIES, MODEL, SECRET, cases
from bench._attack_http import Answer, build, send

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = ("slowloris", "slowbody", "idle", "gzip_bomb", "gzip_bomb_forged")
UPSTREAM_TYPES = {"upstream_error", "service_unavailable", "timeout_error"}

POLICY = """
version: 1
backends:
  up:
    kind: vllm
    replicas: ["http://127.0.0.1:{port}/v1"]
    health: {{interval_s: 60}}
    routing: {{strategy: least_loaded, scrape_interval_s: 0}}
models:
  {model}: {{backend: up, model: {model}}}
tenants:
  attacker: {{api_keys: ["${{ATTACK_TENANT_KEY}}"]}}
surfaces:
  default:
    cache: {{exact: true}}
"""


def _raise_own_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _start_gateway(args: argparse.Namespace, tmp: Path, name: str, key: str) -> _procs.Server:
    port = _procs.free_port()
    cmd = [
        "bash", "-c", 'ulimit -n "$0" && exec "$@"', str(args.gateway_nofile),
        sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp / "policy.yaml"),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {"ATTACK_TENANT_KEY": key, "PYTHONPATH": str(ROOT)}
    return _procs.start(name, cmd, port, tmp, 1 if args.pin else None, env)


def _probe(path: str) -> bytes:
    return build("GET", path, [])


def _log_findings(server: _procs.Server) -> dict[str, int]:
    text = server.log.read_text(errors="replace")
    return {
        "tracebacks": text.count("Traceback (most recent call last)"),
        "error_lines": sum(1 for line in text.splitlines() if " ERROR " in line),
        "key_leaks": sum(1 for line in text.splitlines() if SECRET in line),
        "log_bytes": len(text),
    }


async def _attack(args: argparse.Namespace, tmp: Path, name: str, key: str) -> dict[str, Any]:
    gateway = _start_gateway(args, tmp, f"gateway-{name}", key)
    try:
        await _procs.wait_ready(gateway, _probe("/healthz"), 60)
        before = await well_behaved(gateway.port, key, args.seconds, args.rate, args.timeout)
        sampler = Sampler(gateway.proc.pid)
        rss_before, fds_before = sampler.now()
        sampler.start()
        stop, stats = asyncio.Event(), AttackStats()
        if name.startswith("gzip_bomb"):
            bomb = gzip_bomb(args.bomb_mib << 20, forged=name.endswith("forged"))
            task = asyncio.create_task(
                bomb_senders(gateway.port, key, args.bomb_senders, bomb, stop, stats)
            )
        else:
            count = {"slowloris": args.slowloris, "slowbody": args.slowbody, "idle": args.idle}
            task = asyncio.create_task(
                hold_connections(gateway.port, key, name, count[name], stop, stats)
            )
        await asyncio.sleep(args.ramp)
        during = await well_behaved(gateway.port, key, args.seconds, args.rate, args.timeout)
        held = 0 if name.startswith("gzip_bomb") else stats.opened - stats.closed_by_server
        stop.set()
        try:
            await asyncio.wait_for(task, 40)
        except TimeoutError:
            task.cancel()
        await sampler.stop()
        alive = gateway.alive()
    finally:
        gateway.stop()
    ratio = during.p99_ms / before.p99_ms if before.p99_ms else float("inf")
    return {
        "before": vars(before),
        "during": vars(during),
        "p99_ratio": round(ratio, 2),
        "rss_mib_before": round(rss_before, 1),
        "rss_mib_peak": round(max(sampler.rss_mib, default=0.0), 1),
        "fds_before": fds_before,
        "fds_peak": max(sampler.fds, default=0),
        "attack": {
            "connections_opened": stats.opened,
            "refused": stats.refused,
            "closed_by_gateway": stats.closed_by_server,
            "still_held_at_end": held,
            "answers": stats.answers,
        },
        "gateway_alive": alive,
        "log": _log_findings(gateway),
    }


def _classify(answer: Answer) -> str:
    if answer.status == 0:
        return "no_answer"
    if answer.status < 500:
        return "ok" if answer.status < 400 else "client_error"
    err = answer.error_json()
    if answer.status == 500 or err is None or err.get("type") not in UPSTREAM_TYPES:
        return "own_5xx"
    return "upstream_5xx"


async def _fuzz(args: argparse.Namespace, tmp: Path, key: str) -> dict[str, Any]:
    gateway = _start_gateway(args, tmp, "gateway-fuzz", key)
    per_category: dict[str, dict[str, Any]] = {
        c: {"sent": 0, "statuses": {}, "own_5xx": 0, "upstream_5xx": 0, "no_answer": 0,
            "not_openai_json": 0, "traceback_in_body": 0}
        for c in CATEGORIES
    }  # fmt: skip
    examples: list[dict[str, Any]] = []
    try:
        await _procs.wait_ready(gateway, _probe("/healthz"), 60)
        sampler = Sampler(gateway.proc.pid)
        sampler.start()
        queue = iter(cases(key, args.fuzz_count, args.seed))
        started = time.perf_counter()

        async def worker() -> None:
            for category, raw in queue:
                answer = await send(gateway.port, raw, args.timeout)
                row = per_category[category]
                row["sent"] += 1
                label = str(answer.status) if answer.status else answer.error or "no answer"
                row["statuses"][label] = row["statuses"].get(label, 0) + 1
                kind = _classify(answer)
                if kind in ("own_5xx", "upstream_5xx", "no_answer"):
                    row[kind] += 1
                if answer.status >= 400 and answer.error_json() is None:
                    row["not_openai_json"] += 1
                if b"Traceback" in answer.body:
                    row["traceback_in_body"] += 1
                if kind in ("own_5xx", "no_answer") and len(examples) < args.examples:
                    examples.append(
                        {"category": category, "status": answer.status, "error": answer.error,
                         "request": raw[:200].decode("latin-1") + " ... " + raw[-120:].decode("latin-1"),
                         "answer": answer.body[:200].decode("utf-8", "replace")}
                    )  # fmt: skip

        await asyncio.gather(*(worker() for _ in range(args.fuzz_concurrency)))
        elapsed = time.perf_counter() - started
        began = time.perf_counter()
        scrape = await send(gateway.port, _probe("/metrics"), 30)
        scrape_s = time.perf_counter() - began
        after = await send(gateway.port, good_request(key, -1), args.timeout)
        await sampler.stop()
    finally:
        gateway.stop()
    totals = {
        k: sum(row[k] for row in per_category.values())
        for k in ("sent", "own_5xx", "upstream_5xx", "no_answer", "not_openai_json",
                  "traceback_in_body")
    }  # fmt: skip
    return {
        "totals": totals,
        "seconds": round(elapsed, 1),
        "per_category": per_category,
        "metrics_scrape": {
            "status": scrape.status,
            "bytes": len(scrape.body),
            "seconds": round(scrape_s, 3),
        },
        "good_request_after": after.status,
        "rss_mib_peak": round(max(sampler.rss_mib, default=0.0), 1),
        "log": _log_findings(gateway),
        "examples": examples,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    _raise_own_file_limit()
    key = f"sk-attack-{SECRET}-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="attacks-") as name:
        tmp = Path(args.keep_logs) if args.keep_logs else Path(name)
        tmp.mkdir(parents=True, exist_ok=True)
        up_port = _procs.free_port()
        upstream = _procs.start(
            "upstream",
            [sys.executable, "-m", "bench.fake_upstream", "--port", str(up_port), "--model",
             MODEL, "--latency-ms", str(args.upstream_latency_ms)],
            up_port, tmp, 0 if args.pin else None, {"PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        try:
            await _procs.wait_ready(upstream, _probe("/health"), 60)
            (tmp / "policy.yaml").write_text(POLICY.format(port=up_port, model=MODEL))
            results: dict[str, Any] = {"settings": _settings(args), "attacks": {}}
            for attack in ATTACKS:
                if attack in args.only:
                    results["attacks"][attack] = await _attack(args, tmp, attack, key)
            if "fuzz" in args.only:
                results["fuzz"] = await _fuzz(args, tmp, key)
        finally:
            upstream.stop()
    return results


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("seconds", "rate", "timeout", "ramp", "slowloris", "slowbody", "idle", "bomb_senders",
            "bomb_mib", "gateway_nofile", "fuzz_count", "fuzz_concurrency", "seed")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def _print_summary(results: dict[str, Any]) -> None:
    print("attack           client p50/p99 before -> during (ms)   p99 x  failed  RSS MiB (peak)  "
          "fds peak  held")  # fmt: skip
    for name, r in results["attacks"].items():
        b, d = r["before"], r["during"]
        print(
            f"{name:<16} {b['p50_ms']:>7.1f}/{b['p99_ms']:<8.1f} -> {d['p50_ms']:>7.1f}/"
            f"{d['p99_ms']:<9.1f} {r['p99_ratio']:>6.2f}  {d['failed']:>3}/{d['sent']:<4}"
            f"{r['rss_mib_before']:>6.0f} ({r['rss_mib_peak']:.0f})  {r['fds_peak']:>8}"
            f"  {r['attack']['still_held_at_end']:>4}   log: {r['log']['tracebacks']} tracebacks,"
            f" {r['log']['key_leaks']} key leaks"
        )
    fuzz = results.get("fuzz")
    if fuzz:
        t = fuzz["totals"]
        print(
            f"\nfuzz: {t['sent']} requests in {fuzz['seconds']} s: {t['own_5xx']} 5xx of the "
            f"gateway's own (goal 0), {t['upstream_5xx']} upstream-attributed 5xx, "
            f"{t['no_answer']} without an answer, {t['not_openai_json']} errors not OpenAI JSON, "
            f"{t['traceback_in_body']} tracebacks in bodies"
        )
        print(f"{'category':<15} sent  own5xx  up5xx  noans  statuses")
        for category, row in fuzz["per_category"].items():
            statuses = " ".join(f"{k}:{v}" for k, v in sorted(row["statuses"].items()))
            print(
                f"{category:<15} {row['sent']:>4}  {row['own_5xx']:>6}  {row['upstream_5xx']:>5}"
                f"  {row['no_answer']:>5}  {statuses}"
            )
        m = fuzz["metrics_scrape"]
        print(
            f"/metrics after: status {m['status']}, {m['bytes']} bytes, {m['seconds']} s; "
            f"a good request after: {fuzz['good_request_after']}; RSS peak "
            f"{fuzz['rss_mib_peak']} MiB; log: {fuzz['log']['tracebacks']} tracebacks, "
            f"{fuzz['log']['error_lines']} ERROR lines, {fuzz['log']['key_leaks']} lines with a key"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--only", nargs="+", default=[*ATTACKS, "fuzz"], choices=[*ATTACKS, "fuzz"])
    p.add_argument("--seconds", type=float, default=8.0, help="each client measurement")
    p.add_argument("--rate", type=float, default=25.0, help="client requests a second")
    p.add_argument("--timeout", type=float, default=10.0, help="per request")
    p.add_argument("--ramp", type=float, default=3.0, help="attack running before measuring")
    p.add_argument("--slowloris", type=int, default=1000)
    p.add_argument("--slowbody", type=int, default=500)
    p.add_argument("--idle", type=int, default=1100)
    p.add_argument("--bomb-senders", type=int, default=8)
    p.add_argument("--bomb-mib", type=int, default=60, help="inflated size of one bomb")
    p.add_argument("--gateway-nofile", type=int, default=1024, help="the gateway's file limit")
    p.add_argument("--fuzz-count", type=int, default=6000)
    p.add_argument("--fuzz-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--examples", type=int, default=20, help="failing fuzz cases to keep")
    p.add_argument("--upstream-latency-ms", type=float, default=5.0)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="no taskset pinning")
    p.add_argument("--keep-logs", default="", help="a folder for the processes' logs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.fuzz_count < 1 or args.seconds <= 0 or args.rate <= 0:
        p.error("counts and durations must be positive")
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        results = runner.run(run(args))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        _print_summary(results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
