"""The client matrix: third-party clients, as a new user points them, at the gateway over vLLM.

``python -m deploy.local.client_matrix --python PY [PY...] --node-dir DIR``
starts one local vLLM CPU replica of the tiny model (``deploy.local.localpool``) and the
gateway in front of it (``python -m gateway.cli serve`` with a one-backend policy), then runs
each client's probe (``deploy/local/clients/probe.py`` with the first ``--python``
interpreter whose environment holds that client: clients pin conflicting openai versions, so
they may live in several; ``probe.mjs`` with ``node`` from ``--node-dir``, a folder
whose ``node_modules`` hold the Node clients) and prints one table row per client and API with
the client's version. A client that is not installed shows as ``-``. Exit status 1 if any
probe failed. Installing the clients (not the gateway's dependencies):

    python3 -m venv .venv-clients && .venv-clients/bin/pip install anthropic \\
        langchain-openai langchain-anthropic llm litellm llama-index-llms-openai-like 'openai<3'
        # (litellm and LlamaIndex pin openai 2; openai-agents needs 3)
    .venv/bin/pip install openai anthropic openai-agents             # the dev extra has them
    (cd DIR && npm install openai @anthropic-ai/sdk ai @ai-sdk/openai @ai-sdk/anthropic)
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from deploy.local.localpool import LocalVllmPool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON_PROBES = {  # probe -> the module its client installs
    "openai-python": "openai",
    "anthropic-python": "anthropic",
    "openai-agents": "agents",
    "langchain": "langchain_openai",
    "litellm": "litellm",
    "llm": "llm",
    "llama-index": "llama_index.llms.openai_like",
}
NODE_PROBES = ("openai-node", "anthropic-node", "vercel-ai")
MODEL = "default"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the gateway did not become ready at {url}")


def _has(python: str, module: str) -> bool:
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", check], capture_output=True, check=False).returncode == 0


def _probe(command: list[str], cwd: Path | None, timeout_s: float) -> list[str]:
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"FAIL\t{command[2]}\t-\t(all)\ttimed out after {timeout_s:.0f} s"]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("ok\t", "FAIL\t"))]
    if not rows:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        rows = [f"FAIL\t{command[2]}\t-\t(all)\t{tail[:300]}"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--python", nargs="+", required=True, help="interpreters of clients' venvs")
    parser.add_argument("--node-dir", type=Path, help="folder whose node_modules hold the clients")
    parser.add_argument("--only", nargs="*", help="probe names to run (default: all)")
    args = parser.parse_args()
    port = _free_port()
    rows: list[str] = []
    with LocalVllmPool(1) as pool, tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp, "policy.yaml")
        policy.write_text(
            f'backends:\n  local: {{kind: vllm, replicas: ["{pool.replicas[0]}"]}}\n'
            f"models:\n  {MODEL}: {{backend: local}}\n"
        )
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy),
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base + "/readyz")
            for name, module in PYTHON_PROBES.items():
                if args.only and name not in args.only:
                    continue
                python = next((p for p in args.python if _has(p, module)), None)
                if python is None:
                    rows.append(f"FAIL\t{name}\t-\t(all)\tnot installed in any --python")
                    continue
                rows += _probe(
                    [python, str(HERE / "clients" / "probe.py"), name, base, MODEL], None, 300
                )
            node = shutil.which("node")
            if args.node_dir is not None and node is not None:
                for name in NODE_PROBES:
                    if not args.only or name in args.only:
                        rows += _probe(
                            [node, str(HERE / "clients" / "probe.mjs"), name, base, MODEL],
                            args.node_dir, 300,
                        )  # fmt: skip
        finally:
            gateway.terminate()
            gateway.wait(timeout=15)
    print("| result | client | version | API | detail |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row.split("\t")) + " |")
    return 1 if any(row.startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
