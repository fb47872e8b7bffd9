"""Run one gateway process: the app on its port, signals, a graceful stop.

Used by ``llm-gateway serve`` with one worker, by each worker of a pre-forked group
(``gateway.workers``), and by the demo.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gateway.workgroup import WorkerContext, start_control
from policies.loader import PolicyError, read_policy
from policies.schema import Policy

log = logging.getLogger("llm_gateway")

# In-flight requests get this long to finish on SIGTERM (the supervisor waits a little longer).
DRAIN_S = 28.0


def run_server(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
    worker: WorkerContext | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads the policy file.

    ``worker``: this process is one of a pre-forked group (``gateway.workers``). Raises
    ``PolicyError`` when the policy's runtime cannot be built (a file it names is missing or
    invalid).
    """
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(policy, policy_path, host, port, on_ready, worker))


async def _serve(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None,
    worker: WorkerContext | None = None,
) -> None:
    # Here, not at the top: `llm-gateway check` imports this module's siblings, never the app.
    from gateway.admin import ADMIN_ACCESS, AppAdmin, is_loopback
    from gateway.app import create_app
    from gateway.connections import make_runner
    from gateway.keys import LIVE

    _, source = read_policy(policy_path)
    app = create_app(policy, source, policy_path, group=worker)
    app[ADMIN_ACCESS].listens_beyond_loopback = not is_loopback(host)
    runner = make_runner(app, access_log=None, handler_cancellation=True, shutdown_timeout=DRAIN_S)
    await runner.setup()
    site: web.BaseSite
    if worker is not None and worker.sock is not None:
        site = web.SockSite(runner, worker.sock, backlog=4096)
    else:
        site = web.TCPSite(runner, host, port, backlog=4096, reuse_port=worker is not None)
    await site.start()
    control = None
    if worker is not None:
        control = await start_control(worker, AppAdmin(app, worker.index))
        assert worker.ready_fd is not None
        os.write(worker.ready_fd, f"{worker.index} {os.getpid()}\n".encode())
    # What start-up built (modules, the app, the policy) lives as long as the process: move it
    # out of the collector's generations, so the collections that request garbage triggers
    # no longer walk it (and forked workers keep sharing those pages).
    gc.freeze()
    base_url = f"http://{host}:{port}/v1"
    if worker is None:
        log.info("llm-gateway serving %s on %s", policy_path, base_url)
    if on_ready is not None:
        on_ready(base_url)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
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
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
        if control is not None:
            await control.cleanup()
