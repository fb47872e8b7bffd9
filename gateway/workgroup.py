"""One worker of a pre-forked group: its control socket and the admin answers for the group.

Each worker (``gateway.workers`` forks them) serves the public port and, on a Unix socket in
the supervisor's private run directory (``w<index>.sock``, mode 0700 directory), a control app
that answers for this worker alone. The public ``/metrics`` and ``/admin/*`` of whichever worker
a scrape or an operator reaches ask every sibling over those sockets and answer for the whole
group, so nothing on the request path pays for it (Prometheus' multiprocess mode would put a
lock and an mmap write under every counter increment, and cannot read the collectors that are
computed at scrape time: replica health and load, SLO windows).

- ``/metrics``: counters and histograms summed over the workers; gauges as
  ``gateway.observability.group_metrics`` says (in flight summed, health the minimum, rolling
  SLO percentiles per worker under a ``worker`` label: percentiles of separate windows do not
  add). A replaced or silent worker's counts stay in the sum as last seen
  (``gateway.observability.group_ledger``): the group's counters never go backwards.
- ``/admin/workers``: each worker's pid, requests answered, reloads (and the last one's error)
  and models.
- ``/admin/surfaces``: this worker's view (as with one process), plus every worker's under
  ``workers``.
- ``/admin/cache`` (DELETE): run in every worker (each holds its own index; a shared Redis store
  is purged by the first and found empty by the others); ``purged`` is the sum.
- ``/admin/cache`` (GET): every worker's report, added up (``gateway.group_reports``).
- ``/admin/cache/thresholds`` (DELETE): run in every worker (each gate tightens on its own).
- ``/admin/usage``: every worker's usage records summed (``gateway.group_reports``), or, when
  they live in a shared Redis store, this worker's read of them alone (every worker reads the
  same records: asking each would count them N times); latency is this worker's, as with
  ``/admin/surfaces``.
- ``/admin/reload``: the file is validated here first, with the group's rules (a bad file
  changes nothing, 400); then the supervisor is sent SIGHUP: it reads the file once, decides,
  and every worker applies its decision (``gateway.group_policy``); the answer waits until
  every worker has reloaded.
A sibling that does not answer (being replaced) is left out and named in ``missing``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.admin import (
    UsageRecords,
    check_admin,
    check_metrics,
    no_policy_file,
    policy_rejected,
    usage_answer,
    usage_query,
)
from gateway.build import refuse_unshared_limits
from gateway.errors import BadRequest, GatewayError, error_body
from gateway.group_policy import GroupPolicy
from gateway.group_reports import merge_cache_reports, sum_usage
from gateway.limits.windows import WINDOW_KINDS, Window, window_of
from gateway.observability.group_ledger import Answer, MetricsLedger
from policies.loader import PolicyError, read_policy

CONTROL_TIMEOUT_S = 5.0
RELOAD_WAIT_S = 15.0


@dataclass
class WorkerContext:
    """What a forked worker knows about its group (built by the supervisor before the fork)."""

    index: int
    count: int
    run_dir: Path
    supervisor_pid: int
    sock: socket.socket | None = None  # the inherited listening socket (no SO_REUSEPORT)
    ready_fd: int | None = None  # written once the worker listens
    # The supervisor's record at the fork (``gateway.group_policy``): the generation of the
    # policy this worker starts on and, when the last reload was rejected, its problems (this
    # worker runs the accepted policy, as its siblings do, and reports the rejection as theirs).
    policy: GroupPolicy = field(default_factory=GroupPolicy)

    def control_path(self, index: int) -> Path:
        return self.run_dir / f"w{index}.sock"


class LocalAdmin(Protocol):
    """What one worker answers about itself (``gateway.app.Gateway`` implements it)."""

    @property
    def policy_path(self) -> Path | None: ...

    def metrics_text(self) -> bytes: ...

    def surfaces_view(self) -> dict[str, Any]: ...

    def worker_info(self) -> dict[str, Any]: ...

    async def purge_cache(self, tenant: str, namespace: str | None) -> int: ...

    @property
    def usage_shared(self) -> bool: ...

    async def usage_records(self, tenants: list[str] | None, window: Window) -> UsageRecords: ...

    def cache_report(self) -> dict[str, Any]: ...

    def reset_thresholds(self, namespace: str | None) -> None: ...


LOCAL = web.AppKey("llm_gateway.local_admin", LocalAdmin)
CONTEXT = web.AppKey("llm_gateway.worker", WorkerContext)
LEDGER = web.AppKey("llm_gateway.metrics_ledger", MetricsLedger)
SCRAPES: web.AppKey[itertools.count[int]] = web.AppKey("llm_gateway.scrapes")
PID_HEADER, SEQ_HEADER = "x-worker-pid", "x-worker-scrape"


# --- this worker's control socket -----------------------------------------------------------


def control_app(local: LocalAdmin) -> web.Application:
    app = web.Application()
    app[LOCAL] = local
    app[SCRAPES] = itertools.count(1)
    app.router.add_get("/metrics", _local_metrics)
    app.router.add_get("/admin/workers", _local_worker)
    app.router.add_get("/admin/surfaces", _local_surfaces)
    app.router.add_delete("/admin/cache", _local_purge)
    app.router.add_get("/admin/cache", _local_cache_report)
    app.router.add_delete("/admin/cache/thresholds", _local_reset_thresholds)
    app.router.add_get("/admin/usage", _local_usage)
    return app


def leave_run_dir(ctx: WorkerContext, settle_s: float = 2.0) -> None:
    """This worker exits after its supervisor died (SIGKILL, the OOM killer: the supervisor
    removes the run directory at its own exit, and this one will not come): remove this
    worker's socket and, once no sibling's socket answers, the whole directory.

    Of two workers leaving at once, each removes its own socket before it looks at the other's,
    so the one that looks last finds none answering: the directory is removed once every worker
    has left. A sibling that still answers after ``settle_s`` is serving (draining what it has
    in flight) and removes the directory when it leaves; one killed a moment before may still
    answer while the kernel tears it down, hence the wait; one killed earlier, whose socket file
    stayed, refuses connections: gone. Best effort: never raises."""
    try:
        ctx.control_path(ctx.index).unlink(missing_ok=True)
        siblings = [ctx.control_path(i) for i in range(ctx.count) if i != ctx.index]
        deadline = time.monotonic() + settle_s
        while any(_answers(path) for path in siblings):
            if time.monotonic() >= deadline:
                return  # a sibling still serves: it removes the directory when it leaves
            time.sleep(0.05)
        shutil.rmtree(ctx.run_dir, ignore_errors=True)
    except Exception:  # an exiting worker's tidying must never fail it
        return


def _answers(path: Path) -> bool:
    """Whether a worker listens on the control socket ``path`` (still running)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except TimeoutError:
            return True  # its backlog is full: alive, and busy
        except OSError:  # no file (it left), or no listener (it was killed)
            return False
        return True


async def start_control(ctx: WorkerContext, local: LocalAdmin) -> web.AppRunner:
    runner = web.AppRunner(control_app(local), access_log=None)
    await runner.setup()
    path = ctx.control_path(ctx.index)
    path.unlink(missing_ok=True)  # a dead predecessor's socket file
    await web.UnixSite(runner, str(path)).start()
    return runner


async def _local_metrics(request: web.Request) -> web.Response:
    scrapes: itertools.count[int] = request.app[SCRAPES]
    headers = {PID_HEADER: str(os.getpid()), SEQ_HEADER: str(next(scrapes))}
    body = request.app[LOCAL].metrics_text()
    return web.Response(body=body, content_type="text/plain", headers=headers)


async def _local_worker(request: web.Request) -> web.Response:
    return web.json_response(request.app[LOCAL].worker_info())


async def _local_surfaces(request: web.Request) -> web.Response:
    return web.json_response(request.app[LOCAL].surfaces_view())


async def _local_purge(request: web.Request) -> web.Response:
    local = request.app[LOCAL]
    try:
        purged = await local.purge_cache(request.query["tenant"], request.query.get("namespace"))
    except GatewayError as exc:
        return web.json_response(exc.body(), status=exc.status)
    return web.json_response({"purged": purged})


async def _local_cache_report(request: web.Request) -> web.Response:
    try:
        return web.json_response(request.app[LOCAL].cache_report())
    except GatewayError as exc:
        return web.json_response(exc.body(), status=exc.status)


async def _local_reset_thresholds(request: web.Request) -> web.Response:
    try:
        request.app[LOCAL].reset_thresholds(request.query.get("namespace"))
    except GatewayError as exc:
        return web.json_response(exc.body(), status=exc.status)
    return web.json_response({})


async def _local_usage(request: web.Request) -> web.Response:
    """The records of the window ``kind`` holding the instant ``at`` (the asking worker's)."""
    kind, tenant = request.query["window"], request.query.get("tenant")
    if kind not in WINDOW_KINDS:
        return web.json_response(BadRequest("unknown window", param="window").body(), status=400)
    window = window_of(kind, float(request.query["at"]))
    try:
        records = await request.app[LOCAL].usage_records(
            None if tenant is None else [tenant], window
        )
    except GatewayError as exc:
        return web.json_response(exc.body(), status=exc.status)
    return web.json_response(records)


# --- asking every worker --------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    index: int
    status: int
    body: bytes
    pid: int = 0  # the worker's process and how many scrapes it answered (``/metrics`` only)
    seq: int = 0


async def fan_out(
    ctx: WorkerContext, method: str, path: str, params: dict[str, str] | None = None
) -> tuple[list[Reply], list[int]]:
    """Send one request to every worker's control socket (this one's too); replies, missing."""

    async def ask(index: int) -> Reply | None:
        connector = aiohttp.UnixConnector(path=str(ctx.control_path(index)))
        timeout = aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                session.request(method, f"http://worker{path}", params=params) as resp,
            ):
                body = await resp.read()
                pid, seq = resp.headers.get(PID_HEADER, "0"), resp.headers.get(SEQ_HEADER, "0")
                numbers = (int(pid), int(seq)) if pid.isdigit() and seq.isdigit() else (0, 0)
                return Reply(index, resp.status, body, *numbers)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    answers = await asyncio.gather(*(ask(i) for i in range(ctx.count)))
    replies = [a for a in answers if a is not None]
    missing = [i for i, a in enumerate(answers) if a is None]
    return replies, missing


def add_group_routes(app: web.Application, ctx: WorkerContext, local: LocalAdmin) -> None:
    """The group's answers for ``/metrics`` and ``/admin/*`` (admin calls as ``gateway.admin``)."""
    app[CONTEXT] = ctx
    app[LOCAL] = local
    app[LEDGER] = MetricsLedger(ctx.run_dir, ctx.count)
    app.router.add_get("/metrics", _group_metrics)
    app.router.add_get("/admin/workers", _admin(_group_workers))
    app.router.add_get("/admin/surfaces", _admin(_group_surfaces))
    app.router.add_delete("/admin/cache", _admin(_group_purge))
    app.router.add_get("/admin/cache", _admin(_group_cache_report))
    app.router.add_delete("/admin/cache/thresholds", _admin(_group_reset_thresholds))
    app.router.add_get("/admin/usage", _admin(_group_usage))
    app.router.add_post("/admin/reload", _admin(_group_reload))


def _admin(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def admin_only(request: web.Request) -> web.Response:
        check_admin(request)  # the admin token, or loopback (gateway.admin)
        return await handler(request)

    return admin_only


async def _group_metrics(request: web.Request) -> web.Response:
    check_metrics(request)
    replies, _ = await fan_out(request.app[CONTEXT], "GET", "/metrics")
    answers = {r.index: Answer(r.pid, r.seq, r.body.decode()) for r in replies if r.status == 200}
    body = await request.app[LEDGER].group_text(answers)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _group_workers(request: web.Request) -> web.Response:
    replies, missing = await fan_out(request.app[CONTEXT], "GET", "/admin/workers")
    workers = [json.loads(r.body) for r in replies if r.status == 200]
    return web.json_response({"workers": workers, "missing": missing})


async def _group_surfaces(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    replies, missing = await fan_out(ctx, "GET", "/admin/surfaces")
    views = {r.index: json.loads(r.body) for r in replies if r.status == 200}
    own = views.get(ctx.index) or request.app[LOCAL].surfaces_view()
    workers = [{"worker": i, **view} for i, view in sorted(views.items())]
    return web.json_response({**own, "worker": ctx.index, "workers": workers, "missing": missing})


async def _group_purge(request: web.Request) -> web.Response:
    tenant = request.query.get("tenant")
    if not tenant:
        raise BadRequest("the 'tenant' query parameter is required", param="tenant")
    params = {"tenant": tenant}
    if (namespace := request.query.get("namespace")) is not None:
        params["namespace"] = namespace
    answers = await _ask_all(request, "DELETE", "/admin/cache", params)
    if isinstance(answers, web.Response):
        return answers
    ok, missing = answers
    purged = sum(int(b["purged"]) for b in ok)
    return web.json_response({"purged": purged, "tenant": tenant, "missing": missing})


async def _group_cache_report(request: web.Request) -> web.Response:
    answers = await _ask_all(request, "GET", "/admin/cache")
    if isinstance(answers, web.Response):
        return answers
    ok, missing = answers
    return web.json_response({**merge_cache_reports(ok), "missing": missing})


async def _group_reset_thresholds(request: web.Request) -> web.Response:
    namespace = request.query.get("namespace")
    params = {"namespace": namespace} if namespace is not None else None
    answers = await _ask_all(request, "DELETE", "/admin/cache/thresholds", params)
    if isinstance(answers, web.Response):
        return answers
    ok, missing = answers
    return web.json_response({"reset": namespace or "all", "workers": len(ok), "missing": missing})


async def _group_usage(request: web.Request) -> web.Response:
    query = usage_query(request)
    local: LocalAdmin = request.app[LOCAL]
    if local.usage_shared:  # every worker reads the same records: one read is the group's
        records = await local.usage_records(query.tenants, query.window)
        missing: list[int] = []
    else:
        params = {"window": query.window.kind, "at": str(query.window.start.timestamp())}
        if query.one:
            params["tenant"] = query.tenants[0]
        answers = await _ask_all(request, "GET", "/admin/usage", params)
        if isinstance(answers, web.Response):
            return answers
        ok, missing = answers
        records = sum_usage(ok)
    answer = usage_answer(request.app, query, records)
    return web.json_response({**answer, "missing": missing})


async def _ask_all(
    request: web.Request, method: str, path: str, params: dict[str, str] | None = None
) -> tuple[list[Any], list[int]] | web.Response:
    """The workers' answers that came back ok and the workers missing (silent, or refusing
    while others answered); when every worker refused (no cache, a store down), the first
    refusal is the group's answer."""
    replies, missing = await fan_out(request.app[CONTEXT], method, path, params)
    ok = [json.loads(r.body) for r in replies if r.status == 200]
    refused = [r for r in replies if r.status != 200]
    if not ok and refused:
        return web.json_response(json.loads(refused[0].body), status=refused[0].status)
    return ok, sorted(missing + [r.index for r in refused])


async def _group_reload(request: web.Request) -> web.Response:
    ctx, local = request.app[CONTEXT], request.app[LOCAL]
    if local.policy_path is None:
        return no_policy_file()
    try:
        policy, source = await asyncio.to_thread(read_policy, local.policy_path)
        refuse_unshared_limits(policy, source, ctx.count)
    except PolicyError as exc:
        return policy_rejected(exc)
    before, _ = await fan_out(ctx, "GET", "/admin/workers")
    wanted = {r.index: json.loads(r.body)["reloads"] + 1 for r in before if r.status == 200}
    os.kill(ctx.supervisor_pid, signal.SIGHUP)  # it forwards SIGHUP to every worker
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RELOAD_WAIT_S
    pending = dict(wanted)
    failed: dict[int, str] = {}
    while pending and loop.time() < deadline:
        await asyncio.sleep(0.05)
        replies, _ = await fan_out(ctx, "GET", "/admin/workers")
        for r in replies:
            info = json.loads(r.body)
            if r.index in pending and info["reloads"] >= pending[r.index]:
                del pending[r.index]
                if info["reload_error"]:
                    failed[r.index] = info["reload_error"]
    if pending:
        return web.json_response(
            error_body(
                f"reload signalled; workers {sorted(pending)} did not confirm within "
                f"{RELOAD_WAIT_S:g} s",
                "service_unavailable",
                "reload_incomplete",
            ),
            status=503,
        )
    if failed:  # the file changed between the check here and the supervisor's read of it
        errors = set(failed.values())
        detail = (
            errors.pop()  # the supervisor's rejection, which every worker reports
            if len(errors) == 1
            else "; ".join(f"worker {i}: {error}" for i, error in sorted(failed.items()))
        )
        return web.json_response(
            error_body(f"policy rejected: {detail}", "invalid_request_error", "invalid_policy"),
            status=400,
        )  # fmt: skip
    return web.json_response(
        {"status": "reloaded", "policy": str(local.policy_path), "workers": len(wanted)}
    )
