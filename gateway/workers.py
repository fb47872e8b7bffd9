"""Pre-forked workers sharing one listening port, under a supervisor.

``llm-gateway serve --workers N`` (N > 1) runs this supervisor. It loads the policy, binds the
address once, makes a private run directory, and forks N workers; each runs the ordinary
single-process server (``gateway.server.run_server``) on its own event loop.

Sharing the port. With SO_REUSEPORT (Linux, the BSDs) every worker listens on its own socket
bound to the port and the kernel spreads new connections over them by a hash of the connection's
addresses, so keep-alive clients are spread evenly; the supervisor keeps a bound socket that
never listens, so the port stays reserved while a worker is replaced. Without SO_REUSEPORT the
supervisor listens and every worker accepts on that inherited socket (an event loop that wakes
first may take a whole burst of connections: a less even spread).

Supervision runs in the supervisor's only thread. Its signal handlers only note the signal;
the wake-up file descriptor makes ``select`` return, and the loop then acts:
- a worker that exited unasked is forked again, at most ``MAX_RESTARTS`` in
  ``RESTART_WINDOW_S`` (then everything stops: a worker that dies at start would otherwise
  spin);
- SIGHUP: the supervisor re-reads the policy for workers it forks later (a bad file keeps the
  last good one) and forwards SIGHUP to every worker, which reloads its own;
- SIGINT, SIGTERM: SIGTERM to every worker; each stops accepting, finishes the requests in
  flight (aiohttp's graceful shutdown) and exits; one still alive ``drain_s`` later is killed.
Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the supervisor
decides) and get SIGTERM when the supervisor dies (PR_SET_PDEATHSIG).

Per worker, not shared (each as a separate gateway instance would have it): the approximate
prefix index, admission counts, latency windows, hedge budget, health and load views, and the
in-memory cache; Redis-backed cache entries are shared. See the README's "Workers".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.server import run_server
from gateway.workgroup import WorkerContext
from policies.loader import PolicyError, load_policy
from policies.schema import Policy

log = logging.getLogger("llm_gateway.workers")

MAX_RESTARTS = 10
RESTART_WINDOW_S = 60.0
DRAIN_S = 30.0  # then a worker still running is killed (gateway.server drains 28 s)
_HANDLED = (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


def default_workers() -> int:
    """One per core this process may run on (``os.sched_getaffinity``, else ``cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The supervisor's socket: bound (and listening only when the workers will inherit it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if not reuse_port:
        sock.listen(4096)
    sock.set_inheritable(True)
    return sock


@dataclass
class Supervisor:
    policy: Policy
    policy_path: Path
    host: str
    port: int
    workers: int
    on_ready: Callable[[str], None] | None = None
    drain_s: float = DRAIN_S
    reuse_port: bool = hasattr(socket, "SO_REUSEPORT")
    children: dict[int, int] = field(default_factory=dict)  # pid -> worker index
    _restarts: list[float] = field(default_factory=list)
    _signals: list[int] = field(default_factory=list)
    _stopping: bool = False

    def run(self) -> int:
        """Serve until SIGINT or SIGTERM; returns the exit status (0: stopped as asked)."""
        sock = listen_socket(self.host, self.port, self.reuse_port)
        self.port = sock.getsockname()[1]
        run_dir = Path(tempfile.mkdtemp(prefix="llm-gateway-"))
        ready_r, ready_w = os.pipe()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        previous = {sig: signal.signal(sig, self._note) for sig in _HANDLED}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        ctx = WorkerContext(
            index=0,
            count=self.workers,
            run_dir=run_dir,
            supervisor_pid=os.getpid(),
            sock=None if self.reuse_port else sock,
            ready_fd=ready_w,
        )
        status = 0
        try:
            # Load the app's modules here, once: forked workers then share those pages, and
            # frozen objects are never touched by a collection (which would copy them).
            importlib.import_module("gateway.app")
            gc.freeze()
            for index in range(self.workers):
                self._fork(ctx, index)
            status = self._loop(ctx, ready_r, wake_r)
        finally:
            self._stop_all()
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for fd in (ready_r, ready_w, wake_r, wake_w):
                os.close(fd)
            sock.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        return status

    def _note(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _loop(self, ctx: WorkerContext, ready_r: int, wake_r: int) -> int:
        ready = 0
        base_url = f"http://{self.host}:{self.port}/v1"
        while True:
            readable, _, _ = select.select([ready_r, wake_r], [], [], 5.0)
            if ready_r in readable:
                ready += os.read(ready_r, 4096).count(b"\n")
                if ready == self.workers:  # each worker writes one line when it listens
                    log.info("llm-gateway: %d workers serving on %s", self.workers, base_url)
                    if self.on_ready is not None:
                        self.on_ready(base_url)
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            signals, self._signals = self._signals, []
            if signal.SIGINT in signals or signal.SIGTERM in signals:
                log.info(
                    "stopping %d workers (draining up to %g s)", len(self.children), self.drain_s
                )
                return 0
            if signal.SIGHUP in signals:
                self._reload()
            if not self._reap(ctx):
                return 1

    def _reload(self) -> None:
        try:
            self.policy = load_policy(self.policy_path)
        except PolicyError as exc:
            log.error("policy reload rejected; workers keep the running policy:\n%s", exc)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def _reap(self, ctx: WorkerContext) -> bool:
        """Replace each worker that exited; False when they die too often to go on."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return True
            index = self.children.pop(pid, None)
            if index is None:
                continue
            log.error("worker %d (pid %d) exited (%s); starting another", index, pid, _how(status))
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            self._restarts.append(now)
            if len(self._restarts) > MAX_RESTARTS:
                log.error("%d worker exits within %g s: stopping", MAX_RESTARTS, RESTART_WINDOW_S)
                return False
            self._fork(ctx, index)
        return True

    def _fork(self, ctx: WorkerContext, index: int) -> None:
        pid = os.fork()
        if pid:
            self.children[pid] = index
            return
        code = 1
        try:
            code = self._worker(WorkerContext(**{**ctx.__dict__, "index": index}))
        except BaseException:  # a worker's error must never run the supervisor's code
            logging.getLogger("llm_gateway").exception("worker %d failed", index)
        finally:
            os._exit(code)

    def _worker(self, ctx: WorkerContext) -> int:
        signal.set_wakeup_fd(-1)
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != ctx.supervisor_pid:  # the supervisor died before prctl took hold
            return 1
        run_server(self.policy, self.policy_path, self.host, self.port, worker=ctx)
        return 0

    def _stop_all(self) -> None:
        self._stopping = True
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s
        while self.children and time.monotonic() < deadline:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)
                continue
            self.children.pop(pid, None)
        for pid in self.children:
            log.error("worker pid %d still running after %g s: killing it", pid, self.drain_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)
        self.children.clear()


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"status {os.waitstatus_to_exitcode(status)}"


def supervise(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    workers: int,
    on_ready: Callable[[str], None] | None = None,
) -> int:
    try:
        return Supervisor(policy, policy_path, host, port, workers, on_ready).run()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"cannot listen on {host}:{port}: address in use", file=sys.stderr)
            return 1
        raise
