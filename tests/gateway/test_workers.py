"""Pre-forked workers: a real `llm-gateway serve --workers 2` in a subprocess, called over HTTP.

Each test starts the CLI as an operator would, in front of a real fake upstream on loopback,
and checks the group from outside: requests spread over both workers and /metrics sums them;
a killed worker is replaced; SIGHUP (and POST /admin/reload) reloads every worker; SIGTERM lets
a stream in flight finish, then every worker and the supervisor are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, build_policy, pool_policy, serve, vllm

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Group:
    proc: asyncio.subprocess.Process
    root: str
    policy: Path
    tmp: Path | None = None  # the group's TMPDIR: its run directory is made here
    log: Path | None = None  # its stderr

    def run_dirs(self) -> list[Path]:
        assert self.tmp is not None
        return sorted(self.tmp.glob("llm-gateway-*"))

    def client(self, fresh_connections: bool = True) -> openai.AsyncOpenAI:
        """An openai client; by default each request opens a new connection (so the kernel
        spreads them over the workers' sockets)."""
        return openai.AsyncOpenAI(
            base_url=self.root + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=20,
            default_headers={"Connection": "close"} if fresh_connections else None,
        )

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(self.root + path) as resp:
            assert resp.status == 200, await resp.text()
            if path == "/metrics":
                return await resp.text()
            return await resp.json()

    async def workers(self) -> list[dict[str, Any]]:
        answer = await self.get("/admin/workers")
        workers: list[dict[str, Any]] = answer["workers"]
        return workers

    async def wait_for(
        self, check: Callable[[list[dict[str, Any]]], bool], within_s: float = 60.0
    ) -> list[dict[str, Any]]:
        """Polls until ``check`` holds. The bound is generous: a group whose workers import
        the cache stack takes 10 s to start on a busy 2-core machine, and a CI run under load
        passed 20 s (``workers never got there: []``); a working group gets there at once."""
        deadline = time.monotonic() + within_s
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, AssertionError):
                workers = await self.workers()
                if check(workers):
                    return workers
            await asyncio.sleep(0.1)
        raise AssertionError(f"workers never got there: {workers}")


StartGroup = Callable[[str], Awaitable[Group]]


@pytest.fixture
def group_tmp() -> Iterator[Path]:
    """A TMPDIR for the groups a test starts, removed after it: a group killed with its
    workers (SIGKILL to the process group) leaves its run directory behind, here rather than
    in the machine's /tmp. Short (made by ``mkdtemp``, not under ``tmp_path``): the workers'
    Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gw-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _spawn(
    policy: Path, port: int, workers: int, tmp: Path, log: Path | None
) -> asyncio.subprocess.Process:
    """``serve --workers N`` as an operator starts it, in its own session, with TMPDIR ``tmp``;
    stderr to ``log`` when given."""
    err = None if log is None else os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy),
            "--port", str(port), "--workers", str(workers), "--log-level", "WARNING",
            cwd=ROOT, start_new_session=True, env={**os.environ, "TMPDIR": str(tmp)},
            stderr=err,
        )  # fmt: skip
    finally:
        if err is not None:  # the child has its own copy
            os.close(err)


@pytest.fixture
async def start_group(tmp_path: Path, group_tmp: Path) -> AsyncIterator[StartGroup]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(policy_yaml: str) -> Group:
        policy = tmp_path / "policy.yaml"
        policy.write_text(policy_yaml)
        port = _free_port()
        log = tmp_path / f"group{len(procs)}.log"
        proc = await _spawn(policy, port, WORKERS, group_tmp, log)
        procs.append(proc)
        group = Group(proc, f"http://127.0.0.1:{port}", policy, group_tmp, log)
        await group.wait_for(lambda ws: len(ws) == WORKERS)
        return group

    yield start
    for proc in procs:
        # The process group: the supervisor and any worker left (one a test orphaned too).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()


def _requests_total(text: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_gateway_requests"
        for s in family.samples
        if s.name == "llm_gateway_requests_total"
    )


async def _chat(client: openai.AsyncOpenAI, model: str = "m") -> str:
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    return r.choices[0].message.content or ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


async def test_requests_spread_over_workers_and_metrics_sum_them(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    client = group.client()
    answers = await asyncio.gather(*(_chat(client) for _ in range(40)))
    await client.close()
    assert all(a == "hello from the fake upstream" for a in answers)
    workers = await group.workers()
    served = [w["requests"] for w in workers]
    assert len({w["pid"] for w in workers}) == WORKERS
    assert all(n > 0 for n in served), served  # 40 fresh connections hashed over 2 sockets
    assert sum(served) == 40
    text = await group.get("/metrics")
    assert _requests_total(text) == 40  # the group's sum, whichever worker answered
    assert len(up.fake.requests) == 40
    # Rolling SLO percentiles cannot be added: each worker's series keeps its own label.
    latency = [
        s
        for f in text_string_to_metric_families(text)
        if f.name == "llm_gateway_surface_latency_seconds"
        for s in f.samples
    ]
    assert {s.labels["worker"] for s in latency} == {"0", "1"}
    surfaces = await group.get("/admin/surfaces")  # this worker's view, and every worker's
    assert [w["worker"] for w in surfaces["workers"]] == [0, 1]
    assert surfaces["missing"] == [] and "default" in surfaces["surfaces"]


async def test_a_killed_worker_is_replaced_and_the_counts_stay(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    client = group.client()
    await asyncio.gather(*(_chat(client) for _ in range(20)))
    before = await group.workers()
    assert all(w["requests"] > 0 for w in before)  # both workers served some
    assert _requests_total(await group.get("/metrics")) == 20
    victim = before[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    after = await group.wait_for(
        lambda ws: len(ws) == WORKERS and victim not in {w["pid"] for w in ws}
    )
    assert {w["worker"] for w in after} == {0, 1}
    # the replacement counts from zero; the group's counter keeps what the dead one had counted
    assert _requests_total(await group.get("/metrics")) == 20
    answers = await asyncio.gather(*(_chat(client) for _ in range(20)))
    await client.close()
    assert len(answers) == 20
    assert _requests_total(await group.get("/metrics")) == 40
    assert group.proc.returncode is None


async def test_sighup_and_admin_reload_reach_every_worker(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    models = {name: {"backend": "up", "model": "fake-model"} for name in ("m", "m2")}
    group.policy.write_text(build_policy({"up": vllm(up.url)}, models))
    os.kill(group.proc.pid, signal.SIGHUP)
    workers = await group.wait_for(lambda ws: all("m2" in w["models"] for w in ws))
    assert [w["reloads"] for w in workers] == [1] * WORKERS
    client = group.client()
    assert await asyncio.gather(*(_chat(client, "m2") for _ in range(10)))
    await client.close()

    # A bad file: refused before any worker is touched; a good one: every worker confirms.
    group.policy.write_text("backends: {}\nmodels: {x: {backend: nowhere}}\n")
    async with aiohttp.ClientSession() as session:
        async with session.post(group.root + "/admin/reload") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_policy"
        assert [w["reloads"] for w in await group.workers()] == [1] * WORKERS
        group.policy.write_text(pool_policy([up.url]))
        async with session.post(group.root + "/admin/reload") as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["workers"] == WORKERS
    workers = await group.workers()
    assert [w["reloads"] for w in workers] == [2] * WORKERS
    assert all("m2" not in w["models"] for w in workers)


async def _own_answer(group: Group, index: int, path: str) -> Any:
    """Worker ``index``'s answer about itself, over its control socket: a stopped sibling
    cannot hold it up (the public port may hash the connection to that sibling)."""
    (run_dir,) = group.run_dirs()
    connector = aiohttp.UnixConnector(path=str(run_dir / f"w{index}.sock"))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get("http://worker" + path) as resp,
    ):
        return await resp.json()


async def _session_on_worker(group: Group, index: int) -> aiohttp.ClientSession:
    """A session whose one keep-alive connection the kernel gave to worker ``index``."""
    for _ in range(50):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with session.get(group.root + "/admin/surfaces") as resp:
            if (await resp.json())["worker"] == index:
                return session
        await session.close()
    raise AssertionError(f"no connection reached worker {index}")


@pytest.mark.parametrize("trigger", ["sighup", "admin_reload"])
async def test_one_reload_is_one_policy_for_every_worker_though_the_file_changes_meanwhile(
    make_fake: FakeFactory, start_group: StartGroup, trigger: str
) -> None:
    """The supervisor reads the file once per reload and every worker applies what it read.
    Here worker 1 is stopped until worker 0 has reloaded, and the file is replaced by a bad
    one in between (a deploy writing it again): worker 1 must still apply the policy the
    reload read, never reject the newer file while worker 0 serves the older one."""
    up = await make_fake()
    models = {name: {"backend": "up", "model": "fake-model"} for name in ("m", "m2")}
    group = await start_group(build_policy({"up": vllm(up.url)}, models))
    session = await _session_on_worker(group, 0) if trigger == "admin_reload" else None
    stopped = next(w["pid"] for w in await group.workers() if w["worker"] == 1)
    group.policy.write_text(pool_policy([up.url]))  # model m alone
    os.kill(stopped, signal.SIGSTOP)
    posted: asyncio.Task[tuple[int, str]] | None = None
    try:
        if session is None:
            os.kill(group.proc.pid, signal.SIGHUP)
        else:
            posted = asyncio.create_task(_post_on(session, group.root + "/admin/reload"))
        deadline = time.monotonic() + 60
        while (await _own_answer(group, 0, "/admin/workers"))["reloads"] < 1:
            assert time.monotonic() < deadline, "worker 0 never reloaded"
            await asyncio.sleep(0.05)
        group.policy.write_text("backends: {}\nmodels: {x: {backend: nowhere}}\n")
    finally:
        os.kill(stopped, signal.SIGCONT)
    workers = await group.wait_for(lambda ws: len(ws) == WORKERS and all(w["reloads"] for w in ws))
    if posted is not None and session is not None:
        status, text = await posted
        await session.close()
        assert status == 200, text
    assert [("m2" in w["models"], w["reload_error"]) for w in workers] == [(False, None)] * WORKERS
    client = group.client()
    answers = await asyncio.gather(*(_chat(client) for _ in range(10)), return_exceptions=True)
    await client.close()
    assert all(a == "hello from the fake upstream" for a in answers), answers


async def _post_on(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.post(url) as resp:
        return resp.status, await resp.text()


async def test_sigterm_drains_streams_in_flight_then_stops_every_process(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    up = await make_fake(chunks=10, chunk_interval_ms=100)  # a stream of about 1 s
    group = await start_group(pool_policy([up.url]))
    pids = [w["pid"] for w in await group.workers()]
    client = group.client()
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks: list[openai.types.chat.ChatCompletionChunk] = []
    async for chunk in stream:
        if not chunks:
            os.kill(group.proc.pid, signal.SIGTERM)  # mid-stream
        chunks.append(chunk)
    await client.close()
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 10
    assert await asyncio.wait_for(group.proc.wait(), 20) == 0
    assert not any(_alive(pid) for pid in pids)
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", int(group.root.rsplit(":", 1)[1])), 1),
    ):
        pass


async def _post_reload(group: Group) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(group.root + "/admin/reload") as resp,
    ):
        return resp.status, await resp.text()


async def _replace_one(group: Group, index: int = 0) -> list[dict[str, Any]]:
    """Kill worker ``index`` and wait for its replacement (the group must stay up)."""
    victim = next(w["pid"] for w in await group.workers() if w["worker"] == index)
    os.kill(victim, signal.SIGKILL)
    return await group.wait_for(
        lambda ws: len(ws) == WORKERS and victim not in {w["pid"] for w in ws}
    )


async def test_a_rejected_reload_never_reaches_the_workers_started_later(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    """Replacements start from the last policy the group accepted, never from the file: a file
    refused at reload (limits the group cannot count, a missing artifact, bad YAML) would
    otherwise make every replacement fail, and the group stop."""
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    limited = "tenants:\n  a:\n    api_key_sha256: ['" + "0" * 64 + "']\n"
    group.policy.write_text(
        pool_policy([up.url], limited + "    limits: {requests_per_minute: 3}\n")
    )
    status, text = await _post_reload(group)
    assert status == 400 and "need shared_state.redis_url" in text, text
    assert [w["reloads"] for w in await group.workers()] == [0] * WORKERS

    backends = {"up": vllm(up.url), "large": {"kind": "openai", "base_url": up.url}}
    models = {
        "m": {"backend": "up", "model": "fake-model"},
        "auto": {"tiers": ["up", "large"], "artifact": "/nonexistent/difficulty.json"},
    }
    group.policy.write_text(build_policy(backends, models))
    status, text = await _post_reload(group)
    assert status == 400 and "cannot load the tier artifact" in text, text
    workers = await _replace_one(group)
    assert all("auto" not in w["models"] for w in workers), workers

    group.policy.write_text(pool_policy([up.url]) + "  oops: [\n")
    os.kill(group.proc.pid, signal.SIGHUP)
    await group.wait_for(lambda ws: all(w["reload_error"] for w in ws if w["worker"] == 1))
    workers = await _replace_one(group)
    assert all("auto" not in w["models"] for w in workers), workers
    client = group.client()
    assert all(await asyncio.gather(*(_chat(client) for _ in range(10))))
    await client.close()
    assert group.proc.returncode is None


def _gauge(text: str, name: str) -> float:
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == name]  # fmt: skip
    assert len(values) == 1, (name, values)
    return values[0]


async def test_replacements_report_the_rejected_reload_their_siblings_report(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    """A worker forked after the group rejected a reload runs the older policy, as its siblings
    do: /admin/workers and llm_gateway_policy_reload_failing keep saying so after every
    worker has been replaced, and the reload counters count the rejection once per worker."""
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    group.policy.write_text(pool_policy([up.url]) + "no_such_section: 1\n")
    os.kill(group.proc.pid, signal.SIGHUP)
    await group.wait_for(lambda ws: len(ws) == WORKERS and all(w["reload_error"] for w in ws))
    text = await group.get("/metrics")  # the group's ledger keeps what a replaced worker counted
    assert _gauge(text, "llm_gateway_policy_reload_failing") == 1
    for index in range(WORKERS):
        workers = await _replace_one(group, index)
        replaced = next(w for w in workers if w["worker"] == index)
        assert replaced["reloads"] == 0
        assert "no_such_section" in (replaced["reload_error"] or ""), workers
    text = await group.get("/metrics")
    assert _gauge(text, "llm_gateway_policy_reload_failing") == 1
    rejected = 'llm_gateway_policy_reloads_total{result="rejected"}'
    assert f"{rejected} {float(WORKERS)}" in text  # once per worker, never again per replacement

    group.policy.write_text(pool_policy([up.url]))  # fixed: every worker reloads it
    os.kill(group.proc.pid, signal.SIGHUP)
    workers = await group.wait_for(lambda ws: all(w["reloads"] == 1 for w in ws))
    assert all(w["reload_error"] is None for w in workers), workers
    assert _gauge(await group.get("/metrics"), "llm_gateway_policy_reload_failing") == 0
    await _replace_one(group, 0)  # and one forked now starts clean
    assert _gauge(await group.get("/metrics"), "llm_gateway_policy_reload_failing") == 0
    assert all(w["reload_error"] is None for w in await group.workers())


@pytest.mark.parametrize("stale", [False, True], ids=["every_worker", "one_killed_before"])
async def test_workers_orphaned_by_a_killed_supervisor_remove_the_run_directory(
    make_fake: FakeFactory, start_group: StartGroup, stale: bool
) -> None:
    """The supervisor removes the run directory at its exit; killed (SIGKILL, the OOM killer)
    it cannot. Its workers get SIGTERM (PR_SET_PDEATHSIG), stop, and the last to leave removes
    the directory: its sockets, the ledger's files and itself. A worker killed before, whose
    socket file stayed and answers no more, does not keep it."""
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    await group.get("/metrics")  # the ledger writes its files there too
    (run_dir,) = group.run_dirs()
    assert {"w0.sock", "w1.sock", "w0.last", "w1.last"} <= {p.name for p in run_dir.iterdir()}
    pids = [w["pid"] for w in await group.workers()]
    if stale:  # worker 0 dies while the supervisor cannot replace it
        os.kill(group.proc.pid, signal.SIGSTOP)
        os.kill(pids[0], signal.SIGKILL)
    os.kill(group.proc.pid, signal.SIGKILL)
    assert await asyncio.wait_for(group.proc.wait(), 10) == -signal.SIGKILL
    for _ in range(400):  # 20 s: an idle worker's stop takes well under a second
        if not run_dir.exists() and not any(map(_alive, pids)):
            break
        await asyncio.sleep(0.05)
    assert not any(map(_alive, pids))
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


UNSHARED_RESPONSES = "the Responses API's stored responses are kept per worker"


async def test_a_group_without_redis_warns_once_that_stored_responses_are_per_worker(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    """Without shared_state.redis_url each worker keeps its own stored responses: a follow-up
    (previous_response_id) that reaches another worker is not found. One WARNING says so."""
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    assert group.log is not None
    warned = [line for line in group.log.read_text().splitlines() if UNSHARED_RESPONSES in line]
    assert len(warned) == 1, warned
    assert "WARNING" in warned[0]
    assert "shared_state.redis_url" in warned[0] and "--workers 1" in warned[0]
    assert "previous_response_not_found" in warned[0]


async def test_a_second_group_on_a_held_port_is_refused(
    make_fake: FakeFactory, start_group: StartGroup
) -> None:
    """SO_REUSEPORT would let it bind beside the first: the kernel would split the traffic."""
    up = await make_fake()
    group = await start_group(pool_policy([up.url]))
    port = group.root.rsplit(":", 1)[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--policy", str(group.policy),
        "--port", port, "--workers", str(WORKERS), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert err.decode().strip().splitlines() == [
        f"cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert len(await group.workers()) == WORKERS


@pytest.mark.parametrize("workers", [1, WORKERS])
async def test_sighup_while_starting_is_one_reload_once_serving(
    tmp_path: Path, group_tmp: Path, workers: int
) -> None:
    """SIGHUP's default action ends a process: while `serve` (or a worker) builds its runtime,
    one is held, then applied once the server listens."""
    asked, release = asyncio.Event(), asyncio.Event()
    health_checks = 0

    async def health(request: web.Request) -> web.Response:
        nonlocal health_checks
        health_checks += 1
        if health_checks >= workers:
            asked.set()
        await release.wait()  # every process is now building its runtime, before it listens
        return web.Response()

    upstream = web.Application()
    upstream.router.add_get("/health", health)
    runner, url = await serve(upstream)
    policy = tmp_path / "policy.yaml"
    policy.write_text(pool_policy([url]))
    port = _free_port()
    proc = await _spawn(policy, port, workers, group_tmp, None)
    try:
        await asyncio.wait_for(asked.wait(), 30)
        os.kill(proc.pid, signal.SIGHUP)
        await asyncio.sleep(0.2)
        release.set()
        group = Group(proc, f"http://127.0.0.1:{port}", policy)
        reloaded = await group.wait_for(
            lambda ws: len(ws) == workers and all(w["reloads"] == 1 for w in ws)
        )
        assert all(w["reload_error"] is None for w in reloaded)
        assert proc.returncode is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        await runner.cleanup()


TEAM_A_KEY = "sk-team-a-0123456789"
TEAM_A = 'tenants:\n  team-a: {api_keys: ["${TEST_TEAM_A_KEY}"]}\n'


async def _usage_group(
    make_fake: FakeFactory, start_group: StartGroup, extra: str, **sections: Any
) -> Group:
    """A group whose default surface caches exactly, after 20 requests as team-a over fresh
    connections (so both workers serve some)."""
    up = await make_fake()
    cache = {"default": {"cache": {"exact": True, "allow_temperature": True}}}
    group = await start_group(pool_policy([up.url], TEAM_A + extra, surfaces=cache, **sections))
    client = openai.AsyncOpenAI(
        base_url=group.root + "/v1", api_key=TEAM_A_KEY, max_retries=0, timeout=20,
        default_headers={"Connection": "close"},
    )  # fmt: skip
    await asyncio.gather(*(_chat(client) for _ in range(20)))
    await client.close()
    assert all(w["requests"] > 0 for w in await group.workers())
    return group


async def _settled_usage(group: Group, requests: int, within_s: float = 10.0) -> None:
    """Wait until the usage report counts ``requests`` (an unlimited request's usage is written
    up to ``FLUSH_S`` after it ends); with one worker's records alone it never does."""
    deadline = time.monotonic() + within_s
    while (await group.get("/admin/usage?tenant=team-a"))["requests"] != requests:
        assert time.monotonic() < deadline, "the usage report never counted every request"
        await asyncio.sleep(0.05)


async def test_usage_and_the_cache_report_answer_for_the_whole_group(
    make_fake: FakeFactory, start_group: StartGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_TEAM_A_KEY", TEAM_A_KEY)
    group = await _usage_group(make_fake, start_group, "")
    await _settled_usage(group, 20)
    for _ in range(8):  # fresh connections: whichever worker answers
        usage = await group.get("/admin/usage?tenant=team-a")
        assert (usage["requests"], usage["missing"]) == (20, [])
        every = await group.get("/admin/usage")
        assert [t["requests"] for t in every["tenants"] if t["tenant"] == "team-a"] == [20]
        report = await group.get("/admin/cache")
        stats = report["stats"]
        assert stats["exact_hits"] + stats["semantic_hits"] + stats["misses"] == 20, stats
        assert report["missing"] == []
    reset = group.root + "/admin/cache/thresholds"
    async with aiohttp.ClientSession() as session, session.delete(reset) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.json() == {"reset": "all", "workers": WORKERS, "missing": []}


async def test_usage_in_shared_redis_is_counted_once_by_the_group(
    make_fake: FakeFactory,
    start_group: StartGroup,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: RedisServer,
) -> None:
    monkeypatch.setenv("TEST_TEAM_A_KEY", TEAM_A_KEY)
    shared = f"shared_state: {{redis_url: '{redis_server.url}'}}\n"
    group = await _usage_group(make_fake, start_group, shared)
    assert group.log is not None and UNSHARED_RESPONSES not in group.log.read_text()
    await _settled_usage(group, 20)
    for _ in range(8):
        usage = await group.get("/admin/usage?tenant=team-a")
        assert (usage["requests"], usage["missing"]) == (20, [])  # every worker reads the same
