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
- a worker that exited unasked is forked again from the last policy the group accepted (never
  from the file, which may have gone bad since), told when the last reload was rejected (it
  runs the accepted policy and reports that rejection, as its siblings do); one that exits
  before it listens is retried after ``BACKOFF_S``, doubling up to ``MAX_BACKOFF_S``. The group stops when a worker fails
  while the group starts (the same failure would hit every worker), or when more than
  ``MAX_RESTARTS`` exits in ``RESTART_WINDOW_S`` leave no worker serving; a failing
  replacement never stops workers that serve;
- SIGHUP: the supervisor reads the policy file, once, and accepts its text only if workers
  could be built from it (``gateway.build.check_buildable``: ``prepare`` and the group's rules;
  a bad file keeps the last good one); it writes what it decided to the run directory
  (``gateway.group_policy``), then forwards SIGHUP to every worker, which applies that record
  and never reads the file (a file replaced meanwhile cannot split the group);
- SIGINT, SIGTERM: SIGTERM to every worker; each stops accepting, finishes the requests in
  flight and exits within ``gateway.server.DRAIN_S``; one still alive ``drain_s`` later is
  killed.
Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the supervisor
decides) and get SIGTERM when the supervisor dies (PR_SET_PDEATHSIG); the run directory, which
the supervisor removes at its exit, is then removed by the last worker to leave
(``gateway.workgroup.leave_run_dir``).

Per worker, not shared (each as a separate gateway instance would have it): the approximate
prefix index, admission counts, latency windows, hedge budget, health and load views, and the
in-memory cache; Redis-backed cache entries are shared. See the README's "Workers".
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.build import check_buildable
from gateway.group_policy import GroupPolicy
from gateway.server import CannotListen, run_server
from gateway.signals import HeldHup
from gateway.workgroup import WorkerContext, leave_run_dir
from policies.loader import PolicyError, PolicySource, parse_policy_source, read_policy_text
from policies.schema import Policy

log = logging.getLogger("llm_gateway.workers")

MAX_RESTARTS = 10
RESTART_WINDOW_S = 60.0
BACKOFF_S = 0.5  # a replacement that fails before it listens waits this, doubled each time
MAX_BACKOFF_S = 30.0
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
    if reuse_port and port:
        _refuse_if_listened_on(family, host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if not reuse_port:
        sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def _refuse_if_listened_on(family: socket.AddressFamily, host: str, port: int) -> None:
    """EADDRINUSE when anything listens on the address, another group included: SO_REUSEPORT
    would let a second group bind beside it, and the kernel would split the connections
    between two gateways. A probe without SO_REUSEPORT conflicts with every listener
    (SO_REUSEADDR: connections of a previous run in TIME_WAIT do not count)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


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
    # The last good policy's source: workers forked later start from it, never from the file.
    source: PolicySource | None = None
    held_hup: HeldHup | None = None  # SIGHUPs noted since the process started
    # What the workers apply at a reload, and what a worker forked later is told: the accepted
    # policy's generation and, while the last reload was rejected, its problems (it runs the
    # accepted policy, as its siblings do, and must say so).
    group_policy: GroupPolicy = field(default_factory=GroupPolicy)
    children: dict[int, int] = field(default_factory=dict)  # pid -> worker index
    _serving: set[int] = field(default_factory=set)  # pids that listen (wrote their ready line)
    _failed_starts: dict[int, int] = field(default_factory=dict)  # index -> exits before ready
    _due: dict[int, float] = field(default_factory=dict)  # index -> when to fork it again
    _restarts: list[float] = field(default_factory=list)
    _signals: list[int] = field(default_factory=list)
    _ready_buffer: bytes = b""
    _all_ready: bool = False
    _stopping: bool = False

    def run(self, sock: socket.socket | None = None) -> int:
        """Serve until SIGINT or SIGTERM; returns the exit status (0: stopped as asked)."""
        if sock is None:
            sock = listen_socket(self.host, self.port, self.reuse_port)
        self.port = sock.getsockname()[1]
        if self.source is None:
            self.source = PolicySource(str(self.policy_path))
        run_dir = Path(tempfile.mkdtemp(prefix="llm-gateway-"))
        ready_r, ready_w = os.pipe()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        previous = {sig: signal.signal(sig, self._note) for sig in _HANDLED}
        if self.held_hup is not None and self.held_hup.take():
            self._signals.append(signal.SIGHUP)  # arrived while the supervisor started
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
        _warn_unshared_responses(self.policy, self.workers)
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
        while True:
            readable, _, _ = select.select([ready_r, wake_r], [], [], self._wait_s())
            if ready_r in readable:
                self._note_ready(os.read(ready_r, 4096))
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
                self._reload(ctx)
            if not self._reap():
                return 1
            self._fork_due(ctx)

    def _wait_s(self) -> float:
        if not self._due:
            return 5.0
        return max(0.0, min(5.0, min(self._due.values()) - time.monotonic()))

    def _note_ready(self, data: bytes) -> None:
        """Each worker writes ``<index> <pid>`` once it listens."""
        lines = (self._ready_buffer + data).split(b"\n")
        self._ready_buffer = lines.pop()
        for line in lines:
            index, pid = (int(x) for x in line.split())
            if self.children.get(pid) == index:
                self._serving.add(pid)
                self._failed_starts.pop(index, None)
        if not self._all_ready and len(self._serving) == self.workers:
            self._all_ready = True
            base_url = f"http://{self.host}:{self.port}/v1"
            log.info("llm-gateway: %d workers serving on %s", self.workers, base_url)
            if self.on_ready is not None:
                self.on_ready(base_url)

    def _reload(self, ctx: WorkerContext) -> None:
        """Read the file once and accept its text only if workers could be built from it
        (``check_buildable``); the record of that decision is written before any worker is
        sent SIGHUP, and every worker applies it, never the file."""
        try:
            text = read_policy_text(self.policy_path)
            policy, source = parse_policy_source(text, str(self.policy_path))
            check_buildable(policy, source, self.workers)
        except PolicyError as exc:
            log.error("policy reload rejected; workers keep the running policy:\n%s", exc)
            self.group_policy = self.group_policy.rejected(exc)
        else:
            self.policy, self.source = policy, source
            self.group_policy = self.group_policy.accepted(text)
        self.group_policy.write(ctx.run_dir)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def _reap(self) -> bool:
        """Schedule a replacement for each worker that exited; False when the group must stop:
        a worker failed before the group ever served, or none serves and they keep dying."""
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
            served = pid in self._serving
            self._serving.discard(pid)
            if not self._all_ready:  # at start: the same failure would hit every worker
                log.error("worker %d (pid %d) exited (%s) while starting: stopping",
                          index, pid, _how(status))  # fmt: skip
                return False
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            self._restarts.append(now)
            if len(self._restarts) > MAX_RESTARTS and not self._serving:
                log.error("%d worker exits within %g s and no worker serving: stopping",
                          MAX_RESTARTS, RESTART_WINDOW_S)  # fmt: skip
                return False
            failures = 0 if served else self._failed_starts.get(index, 0) + 1
            self._failed_starts[index] = failures
            delay = 0.0 if failures == 0 else min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (failures - 1))
            log.error("worker %d (pid %d) exited (%s); starting another in %g s",
                      index, pid, _how(status), delay)  # fmt: skip
            self._due[index] = now + delay
        return True

    def _fork_due(self, ctx: WorkerContext) -> None:
        now = time.monotonic()
        for index, due in list(self._due.items()):
            if due <= now:
                del self._due[index]
                self._fork(ctx, index)

    def _fork(self, ctx: WorkerContext, index: int) -> None:
        pid = os.fork()
        if pid:
            self.children[pid] = index
            return
        code = 1
        try:
            fields = {**ctx.__dict__, "index": index, "policy": self.group_policy}
            code = self._worker(WorkerContext(**fields))
        except PolicyError as exc:  # the runtime could not be built: one line, no traceback
            logging.getLogger("llm_gateway").error("worker %d cannot start:\n%s", index, exc)
        except BaseException:  # a worker's error must never run the supervisor's code
            logging.getLogger("llm_gateway").exception("worker %d failed", index)
        finally:
            os._exit(code)

    def _worker(self, ctx: WorkerContext) -> int:
        signal.set_wakeup_fd(-1)
        held = HeldHup()  # the supervisor's handler must not run here, nor SIGHUP kill it
        for sig in _HANDLED:
            if sig != signal.SIGHUP:
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        try:
            if os.getppid() != ctx.supervisor_pid:  # the supervisor died before prctl took hold
                return 1
            run_server(
                self.policy,
                self.policy_path,
                self.host,
                self.port,
                worker=ctx,
                source=self.source,
                held_hup=held,
            )
            return 0
        finally:
            if os.getppid() != ctx.supervisor_pid:  # orphaned: no supervisor will tidy up
                leave_run_dir(ctx)

    def _stop_all(self) -> None:
        self._stopping = True
        self._due.clear()
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


def _warn_unshared_responses(policy: Policy, workers: int) -> None:
    """Stored Responses live in each worker's memory without ``shared_state.redis_url``: once,
    at the group's start, say what that does (a group may not use the Responses API at all,
    so it is no reason to refuse to start)."""
    if workers > 1 and policy.models and not policy.shared_state.redis_url:
        log.warning(
            "the Responses API's stored responses are kept per worker (no "
            "shared_state.redis_url): with %d workers a request naming a previous_response_id "
            "fails with 400 previous_response_not_found, and GET /v1/responses/{id} with 404, "
            "whenever it reaches another worker than the one that stored it; set "
            "shared_state.redis_url to share them, or serve with --workers 1",
            workers,
        )


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
    *,
    source: PolicySource | None = None,
    held_hup: HeldHup | None = None,
) -> int:
    """Run a group; raises ``CannotListen`` when the address cannot be listened on."""
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    try:
        sock = listen_socket(host, port, reuse_port)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {reason}") from exc
    supervisor = Supervisor(
        policy, policy_path, host, port, workers, on_ready, source=source, held_hup=held_hup
    )
    return supervisor.run(sock)
