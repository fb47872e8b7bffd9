"""The demo (``make demo``): two local vLLM CPU replicas with a tiny model, and the gateway.

Run from the repository root: ``python -m deploy.local.demo [--host H] [--port P]``. The
replicas are started by ``deploy.local.localpool``; the gateway serves
``policies/examples/demo.yaml`` with the replicas' addresses in ``DEMO_REPLICA_<i>``, with
one worker per core (``--workers``, as ``llm-gateway serve``). Ctrl-C stops the gateway and
both replicas.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.local.localpool import LocalVllmPool
from gateway.server import CannotListen, run_server
from gateway.workers import default_workers, supervise
from policies.loader import PolicyError, load_policy

DEMO_POLICY = Path(__file__).resolve().parents[2] / "policies" / "examples" / "demo.yaml"


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None when it can."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.local.demo", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("DEMO_PORT") or 8080),
        help="the gateway's port (default: $DEMO_PORT, else 8080)",
    )  # fmt: skip
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--workers", type=int, default=None, help="gateway workers (default: one per core)"
    )
    args = parser.parse_args(argv)
    taken = port_taken(args.host, args.port)
    if taken:  # before a minute of starting vLLM, not after
        print(
            f"port {args.port} on {args.host} is in use ({taken}): stop what holds it, or pick "
            f"another port: make demo DEMO_PORT={args.port + 1} "
            f"(or python -m deploy.local.demo --port {args.port + 1})",
            file=sys.stderr,
        )
        return 2
    workers = args.workers if args.workers is not None else default_workers()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
            policy = load_policy(DEMO_POLICY)
        except PolicyError as exc:
            print(f"demo policy invalid:\n{exc}", file=sys.stderr)
            return 1

        def ready(base_url: str) -> None:
            print(banner(base_url, pool.model_name), flush=True)

        try:
            if workers > 1:
                supervise(policy, DEMO_POLICY, args.host, args.port, workers, ready)
            else:
                run_server(policy, DEMO_POLICY, args.host, args.port, ready)
        except CannotListen as exc:  # taken since the check above
            print(exc, file=sys.stderr)
            return 1
    print("stopped the gateway and the vLLM replicas", flush=True)
    return 0


def banner(base_url: str, model: str) -> str:
    return f"""
llm-gateway is up at {base_url}  (two real vLLM CPU replicas behind it; Ctrl-C stops all)

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="unused")
  r = client.chat.completions.create(model="{model}", max_tokens=16, temperature=0,
                                     messages=[{{"role": "user", "content": "Hello"}}])
  print(r.choices[0].message.content, r.usage)

  curl {base_url}/models      curl {base_url.removesuffix("/v1")}/metrics
"""


if __name__ == "__main__":
    sys.exit(main())
