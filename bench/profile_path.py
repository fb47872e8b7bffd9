"""Where a request's CPU goes: the gateway under cProfile, driven like bench.overhead drives it.

The fake upstream and this process's load generator run on core 0; one gateway process (this
checkout's, one worker, the same policy as bench.overhead's gateway-w1; or, with --proxy floor,
bench._bare_proxy) runs on core 1 with
cProfile on while the load runs: first --seconds of non-streamed requests at --concurrency in
flight (closed loop), then --seconds of streams. Each phase prints the top entries by own time
(tottime) and by cumulative time, per request, so a change to the request path reads as
microseconds per request before and after. cProfile's own cost inflates small, frequent calls
(about 1 us each), so read the ranking and the differences, not the absolute sum.

    python -m bench.profile_path [--proxy gateway|floor] [--seconds 10] [--top 25] [--tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import signal
import sys
import tempfile
from pathlib import Path

import uvloop

from bench import _procs
from bench._overhead_measure import closed_loop
from bench._overhead_servers import MODEL, probe, target


def _serve(policy: Path, port: int, out: Path, floor: str | None) -> None:
    """The gateway (or the floor), profiled between SIGUSR1 (start a phase) and SIGUSR2 (dump)."""

    profiler: list[cProfile.Profile] = []
    phase = [0]

    def start(signum: int, frame: object) -> None:
        profiler[:] = [cProfile.Profile()]
        profiler[0].enable()

    def dump(signum: int, frame: object) -> None:
        if profiler:
            profiler[0].disable()
            phase[0] += 1
            partial = out / f"phase{phase[0]}.prof.part"
            profiler[0].dump_stats(partial)
            partial.rename(out / f"phase{phase[0]}.prof")  # appears whole
            profiler.clear()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    if floor is not None:
        from aiohttp import web

        from bench._bare_proxy import create_app

        loop = uvloop.new_event_loop()
        web.run_app(create_app(floor), host="127.0.0.1", port=port, access_log=None,
                    print=None, loop=loop)  # fmt: skip
        return
    from gateway.server import run_server
    from policies.loader import load_policy

    run_server(load_policy(policy), policy, "127.0.0.1", port)


_IDLE = ("run_until_complete", "run_forever", "select", "poll")


def _report(path: Path, requests: int, top: int, title: str) -> str:
    stats = pstats.Stats(str(path))
    # The event loop's own run call (C) holds the time spent waiting in epoll: not CPU.
    entries = {
        key: row
        for key, row in stats.stats.items()  # type: ignore[attr-defined]
        if not any(idle in key[2] for idle in _IDLE)
    }
    total = sum(tt for (_, _, tt, _, _) in entries.values())
    lines = [f"{title}: {requests} requests, {total / requests * 1e6:.0f} us profiled CPU each"]
    for key, label in (("tottime", "own time"), ("cumtime", "cumulative")):
        index = 2 if key == "tottime" else 3
        ranked = sorted(entries.items(), key=lambda kv: kv[1][index], reverse=True)[:top]
        lines.append(f"  top {top} by {label} (us per request, calls per request, function):")
        for (file, line, func), row in ranked:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
            lines.append(
                f"    {row[index] / requests * 1e6:8.1f}  {row[1] / requests:6.2f}  {func}  {where}"
            )
    return "\n".join(lines)


async def _run(args: argparse.Namespace, tmp: Path) -> str:
    os.sched_setaffinity(0, {0})
    servers: list[_procs.Server] = []
    try:
        up_port = _procs.free_port()
        upstream = _procs.start(
            "upstream",
            [sys.executable, "-m", "bench.fake_upstream", "--port", str(up_port), "--model",
             MODEL, "--latency-ms", "1", "--chunks", "64", "--chunk-interval-ms", "20"],
            up_port, tmp, 0,
        )  # fmt: skip
        servers.append(upstream)
        policy = tmp / "policy.yaml"
        telemetry = (
            "telemetry: {enabled: true, protocol: http, sample_ratio: 1.0,"
            " endpoint: 'http://127.0.0.1:9'}\n"
            if args.tracing
            else ""
        )
        policy.write_text(
            f"backends:\n  up: {{kind: vllm, replicas: ['http://127.0.0.1:{up_port}/v1'],"
            " health: {interval_s: 5}}\n"
            f"models:\n  {MODEL}: {{backend: up}}\n"
            "admission: {max_outstanding_per_replica: 1000000, max_waiting: null}\n" + telemetry
        )
        port = _procs.free_port()
        gateway = _procs.start(
            "gateway",
            [sys.executable, "-m", "bench.profile_path", "--serve", str(policy), "--port",
             str(port), "--out", str(tmp),
             *(["--floor", f"http://127.0.0.1:{up_port}"] if args.proxy == "floor" else [])],
            port, tmp, 1,
        )  # fmt: skip
        servers.append(gateway)
        await _procs.wait_ready(upstream, probe(up_port), 30)
        await _procs.wait_ready(gateway, probe(port), 60)
        out = []
        for phase, (stream, concurrency) in enumerate(
            ((False, args.concurrency), (True, args.stream_concurrency)), start=1
        ):
            load = target(port, stream)
            await closed_loop(load, concurrency, 2.0)  # warm
            os.kill(gateway.proc.pid, signal.SIGUSR1)
            await asyncio.sleep(0.1)
            samples = await closed_loop(load, concurrency, args.seconds)
            os.kill(gateway.proc.pid, signal.SIGUSR2)
            ok = sum(1 for s in samples if s.ok)
            prof = tmp / f"phase{phase}.prof"
            for _ in range(100):
                if prof.exists():
                    break
                await asyncio.sleep(0.1)
            title = "streamed (64 chunks)" if stream else "non-streamed"
            out.append(_report(prof, ok, args.top, f"{title}, {concurrency} in flight"))
        return "\n\n".join(out)
    finally:
        for server in reversed(servers):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_path", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream-concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tracing", action="store_true", help="trace every request (OTLP/HTTP)")
    parser.add_argument("--out", type=Path, default=None, help="keep the .prof files here")
    parser.add_argument(
        "--proxy", choices=("gateway", "floor"), default="gateway", help="what to profile"
    )
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--floor", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve, args.port, args.out, args.floor)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp_dir:
        tmp = args.out or Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        print(uvloop.run(_run(args, tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
