"""Subprocesses for the benchmarks: pinned start, readiness, CPU time and memory, stop.

CPU and memory are read from /proc for the process and all its descendants (LiteLLM may fork
workers), so a figure covers everything the server under test runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pinned(cmd: list[str], core: int | str | None) -> list[str]:
    """Prefix `cmd` with taskset when pinning is possible here (`core`: 1, or a list "0-1")."""
    if core is None or shutil.which("taskset") is None:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _tree(pid: int) -> list[int]:
    children = _children()
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def _status(pid: int) -> dict[str, int]:
    """The kB figures of /proc/PID/status (VmRSS, VmHWM...); empty if the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, value = line.partition(":")
        if value.endswith(" kB"):
            out[name] = int(value.split()[0])
    return out


def _pss(pid: int) -> int:
    """Proportional set size in kB (0 where smaps_rollup cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def cpu_seconds(self) -> float:
        """utime + stime of the process tree, in seconds (clock-tick resolution)."""
        ticks = 0
        for pid in _tree(self.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / _TICKS

    def memory_mib(self) -> tuple[float, float]:
        """(resident now, peak resident) of the process tree, MiB."""
        rss = hwm = 0
        for pid in _tree(self.proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm += int(line.split()[1])
        return rss / 1024, hwm / 1024

    def memory_per_worker(self) -> tuple[float, float, float]:
        """(largest resident set, largest peak, largest proportional set) of one worker, MiB.

        A tree of several processes is a supervisor and its workers: the root is left out.
        Pages a worker shares with its siblings (forked code) count whole in its resident set
        and divided among the sharers in its proportional set (PSS, /proc/PID/smaps_rollup).
        """
        pids = _tree(self.proc.pid)
        if len(pids) > 1:
            pids = pids[1:]
        rss = hwm = pss = 0
        for pid in pids:
            status = _status(pid)
            rss = max(rss, status.get("VmRSS", 0))
            hwm = max(hwm, status.get("VmHWM", 0))
            pss = max(pss, _pss(pid))
        return rss / 1024, hwm / 1024, pss / 1024

    async def settle(self, idle_share: float = 0.05, within_s: float = 30.0) -> float:
        """Wait until the process tree uses under `idle_share` of a core; returns the wait."""
        begin = time.monotonic()
        while time.monotonic() - begin < within_s:
            before = self.cpu_seconds()
            await asyncio.sleep(0.5)
            if self.cpu_seconds() - before <= idle_share * 0.5:
                break
        return time.monotonic() - begin

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the benchmark process dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(
    name: str,
    cmd: list[str],
    port: int,
    log_dir: Path,
    core: int | str | None,
    env: dict[str, str] | None = None,
) -> Server:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            pinned(cmd, core),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: stop() ends it and its workers
            preexec_fn=_die_with_parent,
        )
    return Server(name, proc, port, log)


async def wait_ready(server: Server, probe: bytes, within_s: float) -> None:
    """Send the raw HTTP request `probe` until the server answers it with 200."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited:\n{server.log_tail()}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        try:
            writer.write(probe)
            status_line = await asyncio.wait_for(reader.readline(), 30)
            if b" 200 " in status_line:
                return
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{server.name} not ready after {within_s:.0f} s:\n{server.log_tail()}")
