"""``llm-gateway``: serve, check a policy, run the demo, and the tools of other packages."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from policies.loader import PolicyError, load_policy
from policies.schema import Policy

log = logging.getLogger("llm_gateway")

# Packages that add their own commands through ``add_commands(subparsers)``.
_COMMAND_MODULES = ("cache.cli", "routing.cli")


def main(argv: list[str] | None = None) -> int:
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

    p = sub.add_parser(
        "demo", help="start two local vLLM CPU replicas with a tiny model and the gateway"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--replicas", type=int, default=2)
    p.set_defaults(func=_cmd_demo)

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional extra that is not installed
            log.debug("commands of %s unavailable: %s", name, exc)
            continue
        module.add_commands(sub)

    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"{args.policy}: invalid policy ({len(exc.issues)} problem(s))", file=sys.stderr)
        for issue in exc.issues:
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
    except PolicyError as exc:
        print(f"{args.policy}: invalid policy, not starting:\n{exc}", file=sys.stderr)
        return 1
    run_server(policy, args.policy, args.host, args.port)
    return 0


def run_server(
    policy: Policy,
    policy_path: Path,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads the policy file."""
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
    from gateway.app import GATEWAY, create_app

    app = create_app(policy, str(policy_path), policy_path)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
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
            await app[GATEWAY].reload()
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from gateway.localpool import LocalVllmPool

    _logging("INFO")
    policy_path = Path(__file__).resolve().parent.parent / "policies/examples/demo.yaml"
    print(
        f"starting {args.replicas} vLLM CPU replicas with the tiny model "
        "(built on first run; about a minute, more on a busy machine)...",
        flush=True,
    )
    with LocalVllmPool(args.replicas) as pool:
        os.environ["DEMO_REPLICAS"] = ",".join(pool.replicas)
        for i, url in enumerate(pool.replicas, start=1):
            os.environ[f"DEMO_REPLICA_{i}"] = url
        try:
            policy = load_policy(policy_path)
        except PolicyError as exc:
            print(f"demo policy invalid:\n{exc}", file=sys.stderr)
            return 1

        def ready(base_url: str) -> None:
            print(_demo_banner(base_url, pool.model_name), flush=True)

        run_server(policy, policy_path, args.host, args.port, ready)
    print("stopped the gateway and the vLLM replicas", flush=True)
    return 0


def _demo_banner(base_url: str, model: str) -> str:
    return f"""
llm-gateway is up at {base_url}  (two real vLLM CPU replicas behind it; Ctrl-C stops all)

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="unused")
  r = client.chat.completions.create(model="{model}", max_tokens=16, temperature=0,
                                     messages=[{{"role": "user", "content": "Hello"}}])
  print(r.choices[0].message.content, r.usage)

  curl {base_url}/models      curl {base_url.removesuffix("/v1")}/metrics
"""


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


if __name__ == "__main__":
    sys.exit(main())
