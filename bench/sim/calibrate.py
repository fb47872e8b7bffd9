"""Compare a profile's shape with real vLLM: ``python -m bench.sim.calibrate [--live]``.

Three scenarios, each defined in token ids so that the simulator and a real server see the
same prompts (``/v1/completions`` accepts ids; ids stay under the tiny model's 8k vocabulary):

* ``short``: one 32-token prompt, 128 tokens out: server TTFT and single-stream tokens/s;
* ``concurrent16``: 16 distinct 32-token prompts at once, 128 tokens each: aggregate tokens/s;
* ``prefix``: a 1,370-token prompt cold, then repeated 8 times one after another: cold and
  warm TTFT and the prefix-cache hits the repeats add.

The simulator side runs the engine offline on a synthetic clock (deterministic). ``--live``
also runs the scenarios against one real vLLM started by ``deploy.local.localpool.LocalVllmPool``
(needs ``.venv-vllm``); its TTFT comes from the server's own histogram, as VLLM-CPU.md advises
on a loaded machine. The reference ranges are the measurements in VLLM-CPU.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.engine import ReplicaEngine
from bench.sim.params import SimParams, load_profile

# Real vllm-cpu 0.32 on this project's machines (docs/simulator.md).
MEASURED: dict[str, tuple[float, float]] = {
    "short.ttft_ms": (10.0, 14.0),
    "short.tokens_per_s": (190.0, 230.0),
    "concurrent16.tokens_per_s": (1200.0, 1900.0),
    "prefix.cold_ttft_ms": (70.0, 110.0),
    "prefix.warm_ttft_ms": (19.0, 32.0),
    "prefix.hits_added": (10240.0, 10240.0),
}
OUT_TOKENS = 128
VOCAB = 8000


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


@dataclass
class _Done:
    arrival: float
    first: float
    last: float
    tokens: int


def _run_offline(engine: ReplicaEngine, batch: Sequence[list[int]]) -> list[_Done]:
    """Submit ``batch`` at the engine's current time and step until it is idle."""
    now = engine.clock
    arrivals: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for ids in batch:
        rid = f"r{len(arrivals)}-{now}"
        engine.add_request(rid, ids, OUT_TOKENS, now)
        arrivals[rid] = now
    while (start := engine.next_step_time()) is not None:
        result = engine.step(start)
        for out in result.outputs:
            first.setdefault(out.request_id, result.end)
            last[out.request_id] = result.end
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    return [_Done(arrivals[r], first[r], last[r], counts[r]) for r in arrivals]


def simulate(params: SimParams) -> dict[str, float]:
    engine = ReplicaEngine(params, name="calibrate")
    out: dict[str, float] = {}
    (short,) = _run_offline(engine, [_ids(1, 32)])
    out["short.ttft_ms"] = (short.first - short.arrival) * 1000
    out["short.tokens_per_s"] = (short.tokens - 1) / (short.last - short.first)
    batch = _run_offline(engine, [_ids(100 + i, 32) for i in range(16)])
    span = max(d.last for d in batch) - min(d.arrival for d in batch)
    out["concurrent16.tokens_per_s"] = sum(d.tokens for d in batch) / span
    long = _ids(7, 1370)
    (cold,) = _run_offline(engine, [long])
    hits_before = engine.counters.prefix_cache_hits
    warm = [_run_offline(engine, [long])[0] for _ in range(8)]
    out["prefix.cold_ttft_ms"] = (cold.first - cold.arrival) * 1000
    out["prefix.warm_ttft_ms"] = statistics.median((d.first - d.arrival) * 1000 for d in warm)
    out["prefix.hits_added"] = float(engine.counters.prefix_cache_hits - hits_before)
    return out


async def live() -> dict[str, float]:
    """The same scenarios against one real vLLM CPU replica (minutes: start-up is ~40 s)."""
    import aiohttp

    from deploy.local.localpool import LocalVllmPool

    async with LocalVllmPool(1) as pool, aiohttp.ClientSession() as http:
        base = pool.replicas[0]
        root = base.removesuffix("/v1")
        model = pool.model_name

        async def metric(name: str) -> float:
            async with http.get(f"{root}/metrics") as r:
                text = await r.text()
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")
            )

        async def stream(ids: list[int]) -> _Done:
            body = {
                "model": model, "prompt": ids, "max_tokens": OUT_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True,
            }  # fmt: skip
            t0 = time.perf_counter()
            first = last = 0.0
            n = 0
            async with http.post(f"{base}/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        last = time.perf_counter()
                        first = first or last
                        n += 1
            return _Done(t0, first, last, n)

        async def server_mean(name: str, ids: list[int]) -> float:
            """Run one request; the mean of histogram ``name`` over it, from the server."""
            s0, c0 = await metric(f"{name}_sum"), await metric(f"{name}_count")
            await stream(ids)
            s1, c1 = await metric(f"{name}_sum"), await metric(f"{name}_count")
            return (s1 - s0) / max(1.0, c1 - c0)

        async def server_ttft(ids: list[int]) -> float:
            return await server_mean("vllm:time_to_first_token_seconds", ids) * 1000

        await stream(_ids(999, 32))  # warm-up: first requests pay one-off costs
        out: dict[str, float] = {}
        out["short.ttft_ms"] = await server_ttft(_ids(1, 32))
        # Decode rate from the server's own decode-time histogram (client chunk timing
        # arrives in bursts on a loaded machine).
        decode_s = await server_mean("vllm:request_decode_time_seconds", _ids(2, 32))
        out["short.tokens_per_s"] = (OUT_TOKENS - 1) / max(1e-9, decode_s)
        t0 = time.perf_counter()
        batch = await asyncio.gather(*(stream(_ids(100 + i, 32)) for i in range(16)))
        out["concurrent16.tokens_per_s"] = OUT_TOKENS * len(batch) / (time.perf_counter() - t0)
        long = _ids(7, 1370)
        out["prefix.cold_ttft_ms"] = await server_ttft(long)
        hits0 = await metric("vllm:prefix_cache_hits_total")
        warm = [await server_ttft(long) for _ in range(8)]
        out["prefix.warm_ttft_ms"] = statistics.median(warm)
        out["prefix.hits_added"] = await metric("vllm:prefix_cache_hits_total") - hits0
        return out


def _with_shape(values: dict[str, float]) -> dict[str, float]:
    """Add the ratios that describe the shape, whatever the machine's absolute speed."""
    out = dict(values)
    out["shape.cold_over_warm_ttft"] = values["prefix.cold_ttft_ms"] / values["prefix.warm_ttft_ms"]
    out["shape.batch16_speedup"] = (
        values["concurrent16.tokens_per_s"] / values["short.tokens_per_s"]
    )
    return out


MEASURED_SHAPE: dict[str, tuple[float, float]] = {
    # From the ranges above: 70-110 / 19-32 and 1,200-1,900 / 190-230.
    "shape.cold_over_warm_ttft": (70 / 32, 110 / 19),
    "shape.batch16_speedup": (1200 / 230, 1900 / 190),
}


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.2f}".rstrip("0").rstrip(".")


def report(sim: dict[str, float], real: dict[str, float] | None) -> str:
    sim = _with_shape(sim)
    real = _with_shape(real) if real is not None else None
    head = f"{'metric':28} {'VLLM-CPU.md':>16} {'simulator':>10}"
    if real is not None:
        head += f" {'live vLLM':>10} {'sim/live':>8}"
    lines = [head, "-" * len(head)]
    for key, (lo, hi) in {**MEASURED, **MEASURED_SHAPE}.items():
        value = sim[key]
        ok = "ok" if lo * 0.999 <= value <= hi * 1.001 else "OUT"
        line = f"{key:28} {f'{_num(lo)}-{_num(hi)}':>16} {value:10.1f} {ok:3}"
        if real is not None:
            line += f" {real[key]:10.1f} {value / real[key] if real[key] else 0:8.2f}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.calibrate", description=__doc__)
    parser.add_argument("--profile", default="cpu-tiny-llama")
    parser.add_argument("--live", action="store_true", help="also measure a real vLLM (slow)")
    args = parser.parse_args()
    params = load_profile(args.profile)
    sim = simulate(params)
    real = asyncio.run(live()) if args.live else None
    print(f"profile {params.name} ({params.description})")
    print(report(sim, real))


if __name__ == "__main__":
    main()
