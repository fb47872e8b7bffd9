"""``llm-gateway``: serve, check a policy, and the offline tools of other packages.

``serve`` and ``check`` are the gateway's own. The offline tools (``train-router``,
``calibrate``, ``router-eval``, ``cache-eval``) live in ``routing.training`` and
``cache.training``; their module is imported only when its command runs, so serving never
imports training code (or its extras).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from policies.loader import (
    PolicyError,
    PolicyIssue,
    load_policy,
    read_policy,
    read_policy_text,
    validate_policy,
)
from policies.schema import Policy

log = logging.getLogger("llm_gateway")

# Offline commands: the module that adds them (``add_commands(subparsers)``), its help line,
# and the extra that module needs.
_OFFLINE: dict[str, tuple[str, str, str]] = {
    "train-router": ("routing.training.cli", "train the tier router on labelled data", "training"),
    "calibrate": ("routing.training.cli", "turn a routing target into a threshold", "training"),
    "router-eval": ("routing.training.cli", "APGR/CPT of the tier router", "training"),
    "cache-eval": ("cache.training.cli", "cache hit precision and recall on pairs", "cache"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="llm-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--policy", required=True, type=Path, help="policy YAML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("check", help="validate a policy file")
    p.add_argument("policy", type=Path)
    p.set_defaults(func=_cmd_check)

    wanted = _OFFLINE.get(argv[0]) if argv else None
    if wanted is not None:
        module_name, _, extra = wanted
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            print(
                f"llm-gateway {argv[0]} needs the '{extra}' extra "
                f"(pip install 'llm-gateway[{extra}]'): {exc}",
                file=sys.stderr,
            )
            return 2
        module.add_commands(sub)
    else:
        for name, (_, help_text, extra) in _OFFLINE.items():
            sub.add_parser(name, help=f"{help_text} (the '{extra}' extra)")

    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate the file, then load what it names (artifacts, tokenizers) as serving would."""
    from gateway.build import prepare

    issues: list[PolicyIssue] = []
    policy = None
    try:
        policy, source, issues = validate_policy(read_policy_text(args.policy), str(args.policy))
    except PolicyError as exc:
        issues = exc.issues
    if policy is not None:  # what it names (artifacts, tokenizers, extras): all at once
        try:
            prepare(policy, source)
        except PolicyError as exc:
            issues += exc.issues
        except Exception:
            if not issues:
                raise
            # a consequence of the problems already found (a model naming no backend...)
    if issues or policy is None:
        print(f"{args.policy}: invalid policy ({len(issues)} problem(s))", file=sys.stderr)
        for issue in issues:
            print(f"  {issue}", file=sys.stderr)
        return 1
    print(f"{args.policy}: OK: {summary(policy)}")
    return 0


def summary(policy: Policy) -> str:
    replicas = sum(len(getattr(b, "replicas", [None])) for b in policy.backends.values())
    return (
        f"{len(policy.backends)} backend(s) with {replicas} replica(s), "
        f"{len(policy.models)} model alias(es), {len(policy.tenants)} tenant(s), "
        f"{len(policy.surfaces)} surface(s)"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    _logging(args.log_level)
    try:
        policy = load_policy(args.policy)
        run_server(policy, args.policy, args.host, args.port)
    except PolicyError as exc:
        print(f"{args.policy}: invalid policy, not starting:\n{exc}", file=sys.stderr)
        return 1
    return 0


def run_server(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads the policy file.

    Raises ``PolicyError`` when the policy's runtime cannot be built (a file it names is
    missing or invalid).
    """
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(policy, policy_path, host, port, on_ready))


async def _serve(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None,
) -> None:
    from gateway.admin import ADMIN_ACCESS, is_loopback
    from gateway.app import create_app
    from gateway.connections import make_runner
    from gateway.keys import LIVE

    _, source = read_policy(policy_path)
    app = create_app(policy, source, policy_path)
    app[ADMIN_ACCESS].listens_beyond_loopback = not is_loopback(host)
    runner = make_runner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    base_url = f"http://{host}:{port}/v1"
    log.info("llm-gateway serving %s on %s", policy_path, base_url)
    if on_ready is not None:
        on_ready(base_url)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
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


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


if __name__ == "__main__":
    sys.exit(main())
