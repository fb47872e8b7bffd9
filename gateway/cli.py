"""``llm-gateway``: serve, check a policy, and the offline tools of other packages.

``serve`` and ``check`` are the gateway's own. The offline tools (``train-router``,
``calibrate``, ``router-eval``, ``cache-eval``) live in ``routing.training`` and
``cache.training``; their module is imported only when its command runs, so serving never
imports training code (or its extras).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.signals import HeldHup

if TYPE_CHECKING:  # the policy format is imported once a command runs, after SIGHUP is held
    from policies.schema import Policy

log = logging.getLogger("llm_gateway")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

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
    # First, before anything slow: a SIGHUP while `serve` starts is a reload to apply once it
    # listens, never the end of the process (gateway.signals).
    held_hup = HeldHup() if argv[:1] == ["serve"] else None
    parser = argparse.ArgumentParser(prog="llm-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--policy", required=True, type=Path, help="policy YAML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080, help="1 to 65535")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes sharing the port (default: one per available core; "
        "1: a single process, no supervisor)",
    )
    p.set_defaults(func=_cmd_serve, held_hup=held_hup)

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


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return port


def _cmd_check(args: argparse.Namespace) -> int:
    """Validate the file, then load what it names (artifacts, tokenizers) as serving would."""
    from gateway.build import build_failure, prepare
    from policies.loader import (
        PolicyError,
        PolicyIssue,
        listed,
        read_policy_text,
        validate_policy,
    )

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
        except Exception as exc:
            if not issues:  # else a consequence of those (a model naming no backend...)
                issues += build_failure(source, exc).issues
    if issues or policy is None:
        print(f"{args.policy}: invalid policy ({len(issues)} problem(s))", file=sys.stderr)
        for line in listed(issues):
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{args.policy}: OK: {summary(policy)}")
    if policy.server.route_detail_headers:
        print(
            f"{args.policy}: note: server.route_detail_headers: answers tell every caller how "
            "much of its prompt the replica held, shared across tenants: for debugging only"
        )
    return 0


def summary(policy: Policy) -> str:
    replicas = sum(len(getattr(b, "replicas", [None])) for b in policy.backends.values())
    return (
        f"{len(policy.backends)} backend(s) with {replicas} replica(s), "
        f"{len(policy.models)} model alias(es), {len(policy.tenants)} tenant(s), "
        f"{len(policy.surfaces)} surface(s)"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.build import refuse_unshared_limits
    from gateway.server import CannotListen, run_server
    from gateway.workers import default_workers, supervise
    from policies.loader import PolicyError, read_policy

    _logging(args.log_level)
    workers = args.workers if args.workers is not None else default_workers()
    if workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    try:
        policy, source = read_policy(args.policy)
        refuse_unshared_limits(policy, source, workers)
        if workers > 1:
            return supervise(
                policy, args.policy, args.host, args.port, workers,
                source=source, held_hup=args.held_hup,
            )  # fmt: skip
        run_server(policy, args.policy, args.host, args.port, source=source, held_hup=args.held_hup)
    except PolicyError as exc:
        print(f"{args.policy}: invalid policy, not starting:\n{exc}", file=sys.stderr)
        return 1
    except CannotListen as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


if __name__ == "__main__":
    sys.exit(main())
