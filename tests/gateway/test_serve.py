"""One `serve` process, started as an operator would: its bounded stop, and the address and
flag errors it answers with one line (never a traceback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from tests.conftest import FakeFactory, build_policy, pool_policy, vllm

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 3.0

# The server as `serve --workers 1` runs it, with a short drain bound (28 s in production).
SERVE = """
import logging
import sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pathlib import Path
from gateway import server
from policies.loader import read_policy
server.DRAIN_S = {drain_s}
path = Path(sys.argv[1])
policy, source = read_policy(path)
server.run_server(policy, path, "127.0.0.1", int(sys.argv[2]), on_ready=lambda url: print(url, flush=True))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def _serving(
    policy: Path, log: Path | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """``SERVE`` on a free port, listening; killed at the end if the test left it running.
    ``log``: where its stderr (the access log, when the policy turns it on) goes."""
    port = _free_port()
    err = log.open("wb") if log is not None else None
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVE.format(drain_s=DRAIN_S), str(policy), str(port),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=err,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), 30)  # listening
        yield proc, port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if err is not None:
            err.close()


async def test_sigterm_ends_streams_still_open_at_the_drain_bound(
    make_fake: FakeFactory, tmp_path: Path
) -> None:
    """The whole stop takes at most the drain bound: a stream longer than it is ended (aiohttp
    alone waits its shutdown timeout twice for a handler that streams) with an error event
    saying why, and a request still waiting for its answer gets a 503 to retry elsewhere."""
    up = await make_fake(chunks=100, chunk_interval_ms=100)  # a 10 s stream
    slow = await make_fake(latency_ms=20_000)  # an answer 20 s away
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        build_policy(
            {"up": vllm(up.url), "slow": vllm(slow.url)},
            {"m": {"backend": "up", "model": "fake-model"}, "s": {"backend": "slow"}},
            server={"access_log": True},
        )
    )
    log = tmp_path / "serve.log"
    async with _serving(policy, log) as (proc, port):
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        waiting = asyncio.create_task(
            client.chat.completions.create(model="s", messages=[{"role": "user", "content": "hi"}])
        )
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        received = 0
        with pytest.raises(openai.APIError, match="shutting down: the answer was cut short"):
            async for _ in stream:
                received += 1
                if received == 1:
                    started = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIStatusError, match="shutting down") as refused:
            await waiting
        assert refused.value.status_code == 503
        assert refused.value.code == "shutting_down"  # as the cut stream's error event says
        assert refused.value.response.headers["retry-after"] == "1"
        assert await asyncio.wait_for(proc.wait(), 3 * DRAIN_S) == 0
        assert time.monotonic() - started < DRAIN_S + 1.0
        assert received < 100
        await client.close()
    # Both are the gateway's 503s in its counts: the cut stream was logged a 499 (a client
    # that left) before.
    lines = [line for line in log.read_text().splitlines() if "/v1/chat/completions" in line]
    assert len(lines) == 2 and all(" 503 " in line for line in lines), lines


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "serve", *args],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=60,
    )  # fmt: skip


def test_bad_flags_are_refused_by_the_parser(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(pool_policy(["http://127.0.0.1:9/v1"]))
    for flags, message in (
        (["--port", "70000"], "argument --port: '70000' is not a port (1 to 65535)"),
        (["--port", "0"], "argument --port: '0' is not a port"),
        (["--log-level", "bogus"], "argument --log-level: invalid choice: 'BOGUS'"),
    ):
        proc = _serve("--policy", str(policy), "--workers", "1", *flags)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_address_that_cannot_be_listened_on_is_one_line(tmp_path: Path, workers: str) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(pool_policy(["http://127.0.0.1:9/v1"]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = _serve("--policy", str(policy), "--workers", workers, "--port", port)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot listen on 127.0.0.1:{port}: ") and "in use" in last
    proc = _serve("--policy", str(policy), "--workers", workers, "--host", "no.such.host.invalid")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("cannot listen on no.such.host.invalid")
    for run in (proc,):
        assert "Traceback" not in run.stderr and "Unclosed" not in run.stderr
    assert os.path.exists(policy)


async def test_a_surface_deadline_under_uvloop_ends_streams_gracefully(
    make_fake: FakeFactory, tmp_path: Path
) -> None:
    """uvloop may fire the deadline's timer a little before ``perf_counter`` reaches it: the
    relay must still read that as the deadline (a graceful ``length`` end), not as the upstream
    going silent (an error event, a failure charged to the replica, ejected after two)."""
    up = await make_fake(chunks=40, chunk_interval_ms=20)  # 0.8 s of stream, cut at 0.25 s
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        build_policy(
            {"up": {**vllm(up.url), "health": {"eject_after": 2, "cooldown_s": 600}}},
            {"m": {"backend": "up", "model": "fake-model"}},
            surfaces={
                "fast": {
                    "match": {"header": "fast"},
                    "budget": {"total_ms": 250},
                    "actions": {"deadline": True},
                }
            },
        )
    )
    async with _serving(policy) as (_, port):
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
            default_headers={"X-Surface": "fast"},
        )  # fmt: skip

        async def one() -> str | None:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            finish = None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return finish

        for _ in range(6):
            assert await asyncio.gather(*(one() for _ in range(10))) == ["length"] * 10
        await client.close()
