"""Load for ``bench.budgets``: the real gateway in-process, streaming clients, per-surface stats.

Times are simulated: the simulator runs ``time_scale`` real seconds per simulated second, so
client-side wall times are divided by ``time_scale`` before they are reported, and budgets in
the gateway's policy are written in wall milliseconds (simulated x ``time_scale``).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from bench.fake_upstream import site_port
from gateway.app import create_app
from policies.loader import parse_policy

_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class Sample:
    surface: str
    started: float  # wall, loop clock
    ttft_s: float | None  # wall
    ended: float
    ok: bool
    status: int
    hedge: str | None = None  # x-gateway-hedge: which attempt won, when a hedge fired
    replica: str | None = None  # x-gateway-replica


@dataclass
class Recorder:
    samples: list[Sample] = field(default_factory=list)
    sent: int = 0
    awaiting_first: int = 0  # requests sent that have neither a first token nor an end yet


@asynccontextmanager
async def running_gateway(policy_yaml: str) -> AsyncIterator[str]:
    """The real gateway app built from ``policy_yaml``, on a loopback port; yields its root."""
    app = create_app(parse_policy(policy_yaml, "bench-budgets.yaml"))
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site_port(site)}"
    finally:
        await runner.cleanup()


def prompt(rng: random.Random, tokens: int) -> str:
    """Unique text of about ``tokens`` simulator tokens (one per space-led 5-letter word)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(" " + "".join(rng.choices(letters, k=5)) for _ in range(tokens))


async def stream_one(
    session: aiohttp.ClientSession,
    root: str,
    surface: str,
    text: str,
    max_tokens: int,
    rec: Recorder,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    rec.sent += 1
    body = {
        "model": "sim-llama",
        "prompt": text,
        "max_tokens": max_tokens,
        "stream": True,
    }
    ttft: float | None = None
    status = 0
    ok = False
    hedge = replica = None
    rec.awaiting_first += 1
    try:
        async with session.post(
            root + "/v1/completions", json=body, headers={"X-Surface": surface}
        ) as resp:
            status = resp.status
            hedge = resp.headers.get("x-gateway-hedge")
            replica = resp.headers.get("x-gateway-replica")
            tail = b""
            async for data in resp.content.iter_any():
                if ttft is None and status == 200:
                    ttft = loop.time() - started
                    rec.awaiting_first -= 1
                tail = (tail + data)[-32:]
            ok = status == 200 and _DONE in tail
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    finally:
        if ttft is None:
            rec.awaiting_first -= 1
        # Also when cancelled at the end of a run: a request cut off before its first token
        # must count as a miss, not vanish from the statistics.
        rec.samples.append(Sample(surface, started, ttft, loop.time(), ok, status, hedge, replica))


async def poisson(
    rate_per_s: float,
    time_scale: float,
    until: float,
    rng: random.Random,
    send: Callable[[], asyncio.Task[None]],
) -> None:
    """Open-loop arrivals at ``rate_per_s`` simulated requests per second until wall ``until``."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(rng.expovariate(rate_per_s) * time_scale)
        if loop.time() >= until:
            return
        send()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class SurfaceStats:
    surface: str
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    attainment: float | None
    throughput_rps: float


def surface_stats(
    samples: list[Sample],
    surface: str,
    window: tuple[float, float],
    time_scale: float,
    ttft_budget_ms: float | None,
) -> SurfaceStats:
    """Requests that started in ``window`` (wall); throughput counts those that ended in it.

    Percentiles are over requests that got a first token (in simulated ms); attainment counts
    a request without one (an error, a 503 from admission, cut off at the end) as a miss.
    """
    start, end = window
    mine = [s for s in samples if s.surface == surface and start <= s.started < end]
    ok = [s for s in mine if s.ttft_s is not None]
    ttfts = [(s.ttft_s or 0.0) * 1000.0 / time_scale for s in ok]
    met = sum(1 for t in ttfts if ttft_budget_ms is None or t <= ttft_budget_ms)
    finished = sum(1 for s in samples if s.surface == surface and s.ok and start <= s.ended < end)
    sim_seconds = (end - start) / time_scale
    return SurfaceStats(
        surface=surface,
        requests=len(mine),
        errors=len(mine) - len(ok),
        ttft_p50_ms=_r(percentile(ttfts, 0.50)),
        ttft_p95_ms=_r(percentile(ttfts, 0.95)),
        ttft_p99_ms=_r(percentile(ttfts, 0.99)),
        attainment=round(met / len(mine), 4) if mine else None,
        throughput_rps=round(finished / sim_seconds, 3) if sim_seconds > 0 else 0.0,
    )


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=600)
    )
