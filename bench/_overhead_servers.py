"""The servers that bench.overhead compares, started side by side on one fake upstream.

Direct (the upstream itself), the floor (bench._bare_proxy), llm-gateway (its CLI, with a
policy naming the upstream as a one-replica vLLM backend) with one worker and with N (one per
core), the LiteLLM proxy (from .venv-litellm, configured as bench/litellm-env.sh's notes say:
callbacks off, no retries, no spend logs) with one worker and with N, and the Portkey gateway
(from .venv-portkey, bench/portkey-env.sh; routed by its x-portkey-* headers). Single-process
proxies are pinned to one core and the upstream to the load generator's core; the N-worker arms
may run on every core, the generator's included (the core split is in the report).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import _procs
from bench._loadgen import Target
from bench._overhead_report import TRACED, TRACED_ALL

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
LITELLM_KEY = "sk-bench-overhead"
GATEWAY_W1, GATEWAY_WN, LITELLM, LITELLM_WN, PORTKEY = (
    "gateway-w1", "gateway-wN", "litellm", "litellm-wN", "portkey"
)  # fmt: skip
PORTKEY_ENTRY = ROOT / ".venv-portkey/node_modules/@portkey-ai/gateway/build/start-server.js"


def body(stream: bool) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 64,
        "stream": stream,
    }
    return json.dumps(body).encode()


def target(port: int, stream: bool, extra: dict[str, str] | None = None) -> Target:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {LITELLM_KEY}"}
    path = "/v1/chat/completions"
    return Target.build("127.0.0.1", port, path, body(stream), {**headers, **(extra or {})})


def probe(port: int, extra: dict[str, str] | None = None) -> bytes:
    return target(port, False, {**(extra or {}), "Connection": "close"}).raw_request


def portkey_headers(upstream_port: int) -> dict[str, str]:
    """Portkey routes each request by its headers (its readiness probe included)."""
    return {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": f"http://127.0.0.1:{upstream_port}/v1",
    }


@dataclass
class Proxy:
    name: str
    server: _procs.Server | None  # None for direct
    plain: Target
    stream: Target
    otlp_sink_port: int | None = None  # the traced gateway's span receiver


def _gateway_command(policy: Path, workers: int) -> list[str]:
    """This checkout's gateway (``-m gateway.cli`` from the repository root, not whichever
    ``llm-gateway`` script is installed)."""
    return [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy),
            "--host", "127.0.0.1", "--port", "{port}", "--workers", str(workers)]  # fmt: skip


def _litellm_files(
    tmp: Path, upstream_port: int, workers: int
) -> tuple[list[str], dict[str, str]] | None:
    exe = ROOT / ".venv-litellm" / "bin" / "litellm"
    if not exe.exists():
        return None
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "dummy",
                },
            }
        ],
        "litellm_settings": {
            "callbacks": [],
            "success_callback": [],
            "failure_callback": [],
            "num_retries": 0,
        },
        "router_settings": {"num_retries": 0},
        "general_settings": {"disable_spend_logs": True, "disable_error_logs": True},
    }
    path = tmp / "litellm.yaml"
    path.write_text(json.dumps(config, indent=1))  # YAML is a superset of JSON
    env = {
        "LITELLM_MASTER_KEY": LITELLM_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY_DISABLED": "true",
        "LITELLM_LOG": "ERROR",
        "DISABLE_ADMIN_UI": "True",
        "PYTHONDONTWRITEBYTECODE": "",
    }
    cmd = [str(exe), "--config", str(path), "--host", "127.0.0.1", "--num_workers", str(workers)]
    return cmd, env


async def start_all(
    args: argparse.Namespace,
    tmp: Path,
    servers: list[_procs.Server],
    say: Callable[[str], None],
) -> tuple[Proxy, list[Proxy], dict[str, str]]:
    """Start upstream and proxies; returns direct, the proxies, and why any was skipped."""
    python = sys.executable
    proxy_core, load_core = (1, 0) if args.pin else (None, None)
    every_core = f"0-{args.cores - 1}" if args.pin else None
    up_port = _procs.free_port()
    upstream = _procs.start(
        "upstream",
        [python, "-m", "bench.fake_upstream", "--port", str(up_port), "--model", MODEL,
         "--latency-ms", str(args.upstream_latency_ms), "--chunks", str(args.chunks),
         "--chunk-interval-ms", str(args.chunk_interval_ms)],
        up_port, tmp, load_core,
    )  # fmt: skip
    servers.append(upstream)
    skipped: dict[str, str] = {}
    sinks: dict[str, int] = {}
    headers: dict[str, dict[str, str]] = {}
    pending: list[_procs.Server] = []

    def launch(
        name: str, cmd: list[str], env: dict[str, str] | None = None, core: int | str | None = -1
    ) -> None:
        port = _procs.free_port()
        cmd = [c.replace("{port}", str(port)) for c in cmd]
        server = _procs.start(name, cmd, port, tmp, proxy_core if core == -1 else core, env)
        servers.append(server)
        pending.append(server)

    def launch_gateway(
        name: str, telemetry: str, workers: int = 1, sink_port: int | None = None
    ) -> None:
        policy = tmp / f"{name}.yaml"
        # Admission is lifted: its default (64 in flight per replica) protects a real vLLM
        # replica, but with one fake replica it would cap streams (1.3 s each) near 49/s and
        # the rate search would measure the cap, not the relay.
        policy.write_text(
            "backends:\n"
            f"  up: {{kind: vllm, replicas: ['http://127.0.0.1:{up_port}/v1'],"
            " health: {interval_s: 5}}\n"
            "models:\n"
            f"  {MODEL}: {{backend: up}}\n"
            "admission: {max_outstanding_per_replica: 1000000, max_waiting: null}\n" + telemetry
        )
        launch(name, _gateway_command(policy, workers), core=-1 if workers == 1 else every_core)
        if sink_port is not None:
            sinks[name] = sink_port

    launch("floor", [python, "-m", "bench._bare_proxy", "--port", "{port}",
                     "--upstream", f"http://127.0.0.1:{up_port}"])  # fmt: skip
    if not args.skip_gateway:
        launch_gateway(GATEWAY_W1, "")
        if args.cores > 1:
            launch_gateway(GATEWAY_WN, "", workers=args.cores)
    if not args.skip_gateway and args.tracing:
        # The shipped default sampling, and every request traced; each with its own receiver.
        for name, ratio in ((TRACED, ""), (TRACED_ALL, ", sample_ratio: 1.0")):
            sink_port = _procs.free_port()
            sink = _procs.start(
                f"otlp-sink-{len(sinks)}",
                [python, "-m", "bench._otlp_sink", "--port", str(sink_port)],
                sink_port, tmp, load_core,
            )  # fmt: skip
            servers.append(sink)
            await _procs.wait_ready(sink, probe(sink_port), 30)
            telemetry = (
                f"telemetry: {{enabled: true, protocol: http{ratio},"
                f" endpoint: 'http://127.0.0.1:{sink_port}'}}\n"
            )
            launch_gateway(name, telemetry, sink_port=sink_port)
    if not args.skip_litellm:
        for name, workers in ((LITELLM, 1), (LITELLM_WN, args.cores)):
            if workers == 1 and name == LITELLM_WN:
                continue
            found = _litellm_files(tmp, up_port, workers)
            if found is None:
                skipped[name] = ".venv-litellm is missing: run bench/litellm-env.sh"
                continue
            launch(name, [*found[0], "--port", "{port}"], found[1],
                   core=-1 if workers == 1 else every_core)  # fmt: skip
    if not args.skip_portkey:
        if shutil.which("node") is None or not PORTKEY_ENTRY.exists():
            skipped[PORTKEY] = ".venv-portkey is missing: run bench/portkey-env.sh"
        else:
            # Its server has no host option: it listens on every interface.
            launch(PORTKEY, ["node", str(PORTKEY_ENTRY), "--port={port}", "--headless"])
            headers[PORTKEY] = portkey_headers(up_port)
    await _procs.wait_ready(upstream, probe(up_port), 30)
    proxies = []
    for server in pending:
        extra = headers.get(server.name)
        try:
            await _procs.wait_ready(server, probe(server.port, extra), 90)
        except RuntimeError as exc:
            skipped[server.name] = str(exc)
            say(f"{server.name} skipped: {exc}")
            server.stop()
            continue
        proxies.append(Proxy(server.name, server, target(server.port, False, extra),
                             target(server.port, True, extra), sinks.get(server.name)))  # fmt: skip
    direct = Proxy("direct", None, target(up_port, False), target(up_port, True))
    return direct, proxies, skipped
