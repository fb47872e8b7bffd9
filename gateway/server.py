"""Run one gateway process: the app on its port, signals, a graceful stop.

Used by ``llm-gateway serve`` with one worker, by each worker of a pre-forked group
(``gateway.workers``), and by the demo.

The stop is bounded: on SIGINT or SIGTERM the process stops accepting, lets the requests and
streams in flight finish for up to ``DRAIN_S``, ends the ones still running, and exits (the
supervisor of a group kills a worker only after ``gateway.workers.DRAIN_S``, a little longer).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.signals import HeldHup
from gateway.workgroup import WorkerContext, start_control
from policies.loader import PolicyError, PolicySource
from policies.schema import Policy

if TYPE_CHECKING:
    from gateway.connections import GuardedRunner

log = logging.getLogger("llm_gateway")

# The whole stop, from the signal to the exit, takes at most this long (then requests still in
# flight are ended); the supervisor of a group waits a little longer before it kills a worker.
DRAIN_S = 28.0
# Of it, the last part is left for ending what still runs and closing the runtime.
_CUT_S = 1.0


class CannotListen(Exception):
    """The address cannot be listened on (in use, an unknown host, a port out of range)."""


def run_server(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
    worker: WorkerContext | None = None,
    *,
    source: PolicySource | None = None,
    held_hup: HeldHup | None = None,
    drain_s: float | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads the policy file.

    ``source``: where ``policy`` was read from (its lines name later problems); the file is not
    read again here, so a worker replaced after the file went bad still starts on the policy
    its supervisor holds. ``worker``: this process is one of a pre-forked group
    (``gateway.workers``). ``held_hup``: SIGHUPs noted since the process started, applied
    (as one reload) once the server listens. Raises ``PolicyError`` when the policy's runtime
    cannot be built, ``CannotListen`` when the address cannot be listened on. ``drain_s``:
    the bound on the stop (default ``DRAIN_S``, read when called: tests shorten it).
    """
    import uvloop

    setup = _Setup(policy, source or PolicySource(str(policy_path)), policy_path, host, port)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        bound = DRAIN_S if drain_s is None else drain_s
        runner.run(_serve(setup, on_ready, worker, held_hup, bound))


@dataclass(frozen=True)
class _Setup:
    policy: Policy
    source: PolicySource
    path: Path
    host: str
    port: int


async def _serve(
    setup: _Setup,
    on_ready: Callable[[str], None] | None,
    worker: WorkerContext | None,
    held_hup: HeldHup | None,
    drain_s: float,
) -> None:
    # Here, not at the top: `llm-gateway check` imports this module's siblings, never the app.
    from gateway.admin import ADMIN_ACCESS, AppAdmin, is_loopback
    from gateway.app import create_app
    from gateway.connections import make_runner

    app = create_app(setup.policy, setup.source, setup.path, group=worker)
    app[ADMIN_ACCESS].listens_beyond_loopback = not is_loopback(setup.host)
    # aiohttp's own wait runs after ours (``GuardedRunner.drain``), twice at most: its part of
    # the bound is _CUT_S.
    runner = make_runner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=_CUT_S / 2
    )
    await runner.setup()  # builds the runtime: PolicyError if it cannot be built
    control: web.AppRunner | None = None
    stop = asyncio.Event()
    try:
        await _listen(runner, setup.host, setup.port, worker)
        if worker is not None:
            control = await start_control(worker, AppAdmin(app, worker.index))
            assert worker.ready_fd is not None
            os.write(worker.ready_fd, f"{worker.index} {os.getpid()}\n".encode())
        # What start-up built (modules, the app, the policy) lives as long as the process: move
        # it out of the collector's generations, so the collections that request garbage
        # triggers no longer walk it (and forked workers keep sharing those pages).
        gc.freeze()
        base_url = f"http://{setup.host}:{setup.port}/v1"
        if worker is None:
            log.info("llm-gateway serving %s on %s", setup.path, base_url)
        if on_ready is not None:
            on_ready(base_url)
        _handle_signals(app, stop, worker, held_hup)
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.drain(max(0.0, drain_s - _CUT_S))
        if control is not None:
            await control.cleanup()


async def _listen(
    runner: GuardedRunner, host: str, port: int, worker: WorkerContext | None
) -> None:
    site: web.BaseSite
    if worker is not None and worker.sock is not None:
        site = web.SockSite(runner, worker.sock, backlog=4096)
    else:
        site = web.TCPSite(runner, host, port, backlog=4096, reuse_port=worker is not None)
    try:
        await site.start()
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {reason}") from exc


def _handle_signals(
    app: web.Application, stop: asyncio.Event, worker: WorkerContext | None, held: HeldHup | None
) -> None:
    from gateway.keys import LIVE

    loop = asyncio.get_running_loop()
    # A worker stops on SIGTERM only: its supervisor takes SIGINT and decides.
    for sig in (signal.SIGINT, signal.SIGTERM) if worker is None else (signal.SIGTERM,):
        loop.add_signal_handler(sig, stop.set)

    async def reload() -> None:
        try:
            await app[LIVE].reload()
        except PolicyError as exc:
            log.error("policy reload rejected; still running the previous policy:\n%s", exc)

    tasks: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        task = asyncio.create_task(reload())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    if held is not None and held.take():  # SIGHUP while starting: reload once, now
        on_hup()
