"""Run simulated vLLM replicas until Ctrl-C: ``python -m bench.sim --replicas 4``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from bench.sim.cluster import SimCluster
from bench.sim.params import list_profiles, load_profile


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--profile", default="h100-llama3-8b", help=f"one of {list_profiles()}")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per simulated second (0.1 runs 10x faster than real time)",
    )
    p.add_argument("--kv-events", action="store_true", help="publish KV events on ZMQ")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    return p


async def _serve(args: argparse.Namespace) -> None:
    params = load_profile(args.profile)
    cluster = SimCluster(
        args.replicas,
        params,
        time_scale=args.time_scale,
        kv_events=args.kv_events,
        served_model_name=args.served_model_name,
        host=args.host,
    )
    async with cluster:
        print(f"profile {params.name}: {params.description}")
        print(f"model {cluster.served_model_name}, time_scale {args.time_scale}")
        for info in cluster.info:
            events = f"  kv-events {info.kv_events_endpoint}" if info.kv_events_endpoint else ""
            replay = f"  replay {info.kv_replay_endpoint}" if info.kv_replay_endpoint else ""
            print(f"{info.name}  {info.base_url}{events}{replay}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for c in cluster.counters():
            print(
                f"{c.name}: {c.request_success} requests, hit rate {c.hit_rate:.3f}, "
                f"TTFT p50 {c.ttft_p50 * 1000:.1f} ms p99 {c.ttft_p99 * 1000:.1f} ms"
            )


def main() -> None:
    args = _parser().parse_args()
    try:
        import uvloop

        runner: contextlib.AbstractContextManager[asyncio.Runner] = asyncio.Runner(
            loop_factory=uvloop.new_event_loop
        )
    except ImportError:
        runner = asyncio.Runner()
    with runner as r:
        r.run(_serve(args))


if __name__ == "__main__":
    main()
