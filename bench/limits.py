"""Tenant limits under load, side by side: what a burst admits against the limit, and what the
limiter adds to a request, for 1 and 3 gateway instances sharing one Redis.

Every server is its own process on loopback: redis-server, the fake upstream (no latency) and
llm-gateway instances (``python -m gateway.cli serve``) with three policies that differ only
in their limits:

* ``off``: no tenant has limits or a budget, no shared state (the same gateway, limits off);
* ``redis``: ``shared_state.redis_url`` set; the tenant has requests_per_minute,
  tokens_per_minute and max_concurrent, all checked on every request (one Lua script before
  the request, its settlement after; far from the limits, a check takes a grant for the next
  few). No budget: a budgeted request holds its worst-case cost in Redis and takes no grant,
  so it costs what ``redis-each`` measures;
* ``memory``: the same limits kept in the one instance's memory;
* ``redis-each``: as ``redis`` with ``grant_requests: 0``: every request asks Redis (the
  limiter before grants, side by side with it).

1. Burst: for each store and instance count, a tenant with ``requests_per_minute: L`` sends 3L
   concurrent requests spread round-robin over the instances; reported: the admitted count
   against L, the burst's duration and GCRA's bound for that duration (L + floor(duration x
   L / 60 s): a burst that lasts longer than one unit's refill may admit that refill too).
   Then with grants at work: a tenant with ``requests_per_minute: WIDE`` (far enough from
   its limit for grants of 16) asked steadily by 8 clients per instance, 3 instances, until
   2 x WIDE requests were sent: admitted against the same bound, and how many came from
   grants (``llm_gateway_limits_granted_total``).
2. Latency: concurrency 1, non-streamed, the configurations interleaved in blocks (rotating
   order); the added p50 / p99 is a configuration's minus ``off``'s, for the same instance
   count, from the same run. Goal: added p50 <= 0.3 ms with Redis on loopback.

    python -m bench.limits [--quick] [--json] [--rounds N] [--block N] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench import _procs
from bench._loadgen import Target
from bench._overhead_measure import concurrency_one, percentile

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
LIMIT = 60  # requests per minute of the burst tenants: one comes back each second
WIDE = 2_048  # requests per minute of the steady tenant: room for grants of 16 (64 x 16 < 2048)
KEY_WIDE = "sk-bench-limits-wide"
KEY_LOAD = "sk-bench-limits-load"
PRICE = "{input_per_mtok: 0.15, output_per_mtok: 0.6, cached_input_per_mtok: 0.075}"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _burst_key(store: str, instances: int) -> str:
    return f"sk-bench-burst-{store}-{instances}"


def policy(upstream_port: int, store: str, redis_url: str) -> str:
    limited = store != "off"
    tenants = ["tenants:"]
    load = "  load: {api_key_sha256: [" + _digest(KEY_LOAD) + "]"
    if limited:
        load += (
            ", limits: {requests_per_minute: 1000000000, tokens_per_minute: 1000000000,"
            " max_concurrent: 100000}"
        )
    tenants.append(load + "}")
    for n in (1, 3):
        key = _burst_key(store, n)
        rule = f", limits: {{requests_per_minute: {LIMIT}}}" if limited else ""
        tenants.append(f"  burst{n}: {{api_key_sha256: [{_digest(key)}]{rule}}}")
    if limited:
        wide = f"limits: {{requests_per_minute: {WIDE}}}"
        tenants.append(f"  wide: {{api_key_sha256: [{_digest(KEY_WIDE)}], {wide}}}")
    shared = ""
    if store.startswith("redis"):
        grants = ", grant_requests: 0" if store == "redis-each" else ""
        shared = f"shared_state: {{redis_url: '{redis_url}'{grants}}}\n"
    return (
        "backends:\n"
        f"  up: {{kind: vllm, replicas: ['http://127.0.0.1:{upstream_port}/v1'],"
        " health: {interval_s: 5}}\n"
        f"models:\n  {MODEL}: {{backend: up, price: {PRICE}}}\n"
        "admission: {max_outstanding_per_replica: 1000000, max_waiting: null}\n"
        + shared
        + "\n".join(tenants)
        + "\n"
    )


def target(port: int, key: str) -> Target:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    ).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    return Target.build("127.0.0.1", port, "/v1/chat/completions", body, headers)


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclass
class Setup:
    upstream: int
    redis_url: str
    gateways: dict[str, list[_procs.Server]]  # store -> its instances


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()


async def _redis_ready(port: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.write(b"PING\r\n")
        line = await reader.readline()
        writer.close()
        if line.startswith(b"+PONG"):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("redis-server did not start")


async def start(tmp: Path, servers: list[_procs.Server], pin: bool) -> Setup:
    python = sys.executable
    gw_core, load_core = (1, 0) if pin else (None, None)
    up_port, redis_port = _procs.free_port(), _procs.free_port()
    fake = [python, "-m", "bench.fake_upstream", "--port", str(up_port), "--model", MODEL]
    upstream = _procs.start("upstream", fake, up_port, tmp, load_core)
    servers.append(upstream)
    redis = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
    redis += ["--appendonly", "no"]
    servers.append(_procs.start("redis", redis, redis_port, tmp, load_core))
    await _redis_ready(redis_port)
    await _procs.wait_ready(upstream, _get("/health"), 30.0)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    gateways: dict[str, list[_procs.Server]] = {}
    for store, count in (("off", 3), ("redis", 3), ("memory", 1), ("redis-each", 1)):
        file = tmp / f"{store}.yaml"
        file.write_text(policy(up_port, store, redis_url))
        for i in range(count):
            port = _procs.free_port()
            cmd = [python, "-m", "gateway.cli", "serve", "--policy", str(file)]
            cmd += ["--port", str(port), "--log-level", "WARNING"]
            server = _procs.start(f"gateway-{store}-{i}", cmd, port, tmp, gw_core)
            servers.append(server)
            gateways.setdefault(store, []).append(server)
    every = [g for group in gateways.values() for g in group]
    await asyncio.gather(*(_procs.wait_ready(g, _get("/healthz"), 60.0) for g in every))
    return Setup(up_port, redis_url, gateways)


async def burst(ports: list[int], key: str) -> dict[str, Any]:
    targets = [target(port, key) for port in ports]
    started = time.perf_counter()
    samples = await asyncio.gather(
        *(targets[i % len(targets)].one(started) for i in range(3 * LIMIT))
    )
    for t in targets:
        t.close()
    duration = max(s.done for s in samples)
    return {
        "admitted": sum(1 for s in samples if s.ok),
        "limit": LIMIT,
        "requests": len(samples),
        "burst_s": duration,
        "bound": LIMIT + int(duration * LIMIT / 60),
    }


async def steady(ports: list[int], clients: int = 8) -> dict[str, Any]:
    """``clients`` per instance send one request after another, 2 x WIDE in all."""
    targets = [target(port, KEY_WIDE) for port in ports for _ in range(clients)]  # one each
    started = time.perf_counter()
    sent = admitted = 0

    async def client(t: Target) -> None:
        nonlocal sent, admitted
        while sent < 2 * WIDE:
            sent += 1
            ok = (await t.one(started)).ok  # awaited first: ``+=`` would read the old count
            admitted += ok

    await asyncio.gather(*(client(t) for t in targets))
    duration = time.perf_counter() - started
    for t in targets:
        t.close()
    granted = 0
    for port in ports:
        for line in (await _fetch(port, "/metrics")).splitlines():
            if line.startswith(b"llm_gateway_limits_granted_total"):
                granted += int(float(line.split()[-1]))
    return {
        "admitted": admitted,
        "limit": WIDE,
        "requests": sent,
        "burst_s": duration,
        "bound": WIDE + int(duration * WIDE / 60),
        "granted": granted,
    }


async def _fetch(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_get(path))
    data = await reader.read()
    writer.close()
    return data.partition(b"\r\n\r\n")[2]


class RoundRobin:
    """Concurrency-1 requests spread over several instances in turn; their CPU time too."""

    def __init__(self, servers: list[_procs.Server]) -> None:
        self.servers = servers
        self.targets = [target(s.port, KEY_LOAD) for s in servers]
        self.done: list[float] = []
        self.errors = 0
        self.cpu_s = 0.0

    async def block(self, count: int) -> None:
        before = sum(s.cpu_seconds() for s in self.servers)
        for i in range(count):
            sample = (await concurrency_one(self.targets[i % len(self.targets)], 1))[0]
            if sample.ok:
                self.done.append(sample.done * 1000)
            else:
                self.errors += 1
        await asyncio.sleep(0.02)  # let the settlements that follow each answer run
        self.cpu_s += sum(s.cpu_seconds() for s in self.servers) - before

    def close(self) -> None:
        for t in self.targets:
            t.close()


async def latency(setup: Setup, rounds: int, block: int, warm: int) -> dict[str, Any]:
    configs = {
        (store, n): RoundRobin(setup.gateways[store][:n])
        for store, n in (
            ("off", 1),
            ("redis", 1),
            ("redis-each", 1),
            ("memory", 1),
            ("off", 3),
            ("redis", 3),
        )
    }
    for rr in configs.values():
        await rr.block(warm)
        rr.done.clear()
        rr.cpu_s = 0.0
    order = list(configs)
    for r in range(rounds):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            await configs[key].block(block)
    out: dict[str, Any] = {}
    for (store, n), rr in configs.items():
        out[f"{store}/{n}"] = {
            "p50_ms": percentile(rr.done, 50),
            "p99_ms": percentile(rr.done, 99),
            "requests": len(rr.done),
            "errors": rr.errors,
            "cpu_us": rr.cpu_s / max(1, len(rr.done) + rr.errors) * 1e6,
        }
        rr.close()
    return out


def report(bursts: dict[str, Any], lat: dict[str, Any]) -> str:
    lines = [
        f"burst: requests_per_minute = {LIMIT}, {3 * LIMIT} concurrent requests",
        f"{'instances':>9}  {'store':<6}  {'admitted':>8}  {'limit':>5}  {'burst s':>7}  "
        f"{'GCRA bound':>10}",
    ]
    for name, b in bursts.items():
        if name == "steady":
            continue
        store, n = name.split("/")
        lines.append(
            f"{n:>9}  {store:<6}  {b['admitted']:>8}  {b['limit']:>5}  {b['burst_s']:>7.2f}  "
            f"{b['bound']:>10}"
        )
    w = bursts.get("steady")
    if w is not None:
        lines += [
            "",
            f"steady: requests_per_minute = {WIDE}, 8 clients per instance, 3 instances, "
            f"{w['requests']} requests: admitted {w['admitted']} in {w['burst_s']:.2f} s "
            f"(GCRA bound {w['bound']}), {w['granted']} of them from grants",
        ]
    lines += [
        "",
        "latency per request, concurrency 1, non-streamed (ms; added = limits on minus off, "
        "same run, same instance count); gateway CPU per request (us, all instances)",
        f"{'instances':>9}  {'store':<10}  {'off p50':>7}  {'on p50':>7}  {'added p50':>9}  "
        f"{'off p99':>7}  {'on p99':>7}  {'added p99':>9}  {'CPU us off':>10}  {'on':>6}  "
        f"{'errors':>6}",
    ]
    for name in ("memory/1", "redis-each/1", "redis/1", "redis/3"):
        store, n = name.split("/")
        on, off = lat[name], lat[f"off/{n}"]
        lines.append(
            f"{n:>9}  {store:<10}  {off['p50_ms']:>7.3f}  {on['p50_ms']:>7.3f}  "
            f"{on['p50_ms'] - off['p50_ms']:>+9.3f}  {off['p99_ms']:>7.3f}  {on['p99_ms']:>7.3f}  "
            f"{on['p99_ms'] - off['p99_ms']:>+9.3f}  {off['cpu_us']:>10.0f}  {on['cpu_us']:>6.0f}  "
            f"{on['errors'] + off['errors']:>6}"
        )
    added = lat["redis/1"]["p50_ms"] - lat["off/1"]["p50_ms"]
    verdict = "met" if added <= 0.3 else "missed"
    lines.append(f"goal: added p50 <= 0.3 ms with Redis on loopback: {added:.3f} ms ({verdict})")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    servers: list[_procs.Server] = []
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp_dir:
        try:
            setup = await start(Path(tmp_dir), servers, args.pin)
            _say("servers ready; bursts")
            bursts = {}
            for store, n in (("memory", 1), ("redis", 1), ("redis", 3)):
                ports = [g.port for g in setup.gateways[store][:n]]
                bursts[f"{store}/{n}"] = await burst(ports, _burst_key(store, n))
            bursts["steady"] = await steady([g.port for g in setup.gateways["redis"]])
            _say("latency rounds")
            lat = await latency(setup, args.rounds, args.block, args.warm)
        finally:
            for server in reversed(servers):
                server.stop()
    return {"bursts": bursts, "latency": lat, "cpus": os.cpu_count()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-pin", dest="pin", action="store_false")
    args = p.parse_args(argv)
    args.pin = args.pin and (os.cpu_count() or 1) >= 2
    if args.rounds is None:
        args.rounds = 2 if args.quick else 10
    args.warm = 50 if args.quick else 300
    if args.quick:
        args.block = min(args.block, 50)
    return args


def run(argv: list[str] | None = None) -> None:
    args = parse(argv)
    result = uvloop.run(main(args))
    print(
        json.dumps(result, indent=2) if args.json else report(result["bursts"], result["latency"])
    )


if __name__ == "__main__":
    run()
