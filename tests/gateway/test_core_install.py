"""``pip install .`` with no extras checks a policy and serves a request; a policy that needs an
extra says which, in one line.

A fresh virtual environment is built from the working tree (no editable install, no extras),
so this proves the core dependencies and the import graph, not just this machine's venv.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import FakeFactory

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # A copy of the tree without build leftovers, installed as a user would (not editable).
    src = venv.parent / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", ".cache", "*.egg-info", "build", "__pycache__"
        ),
    )
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    proc = subprocess.run([*pip, str(src)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def run(
    venv: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "llm-gateway"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=venv.parent,
        check=False,
        timeout=120,
    )


def test_the_core_install_has_no_heavy_extras(core_venv: Path) -> None:
    python = str(core_venv / "bin" / "python")
    for module in ("numpy", "faiss", "sklearn", "torch", "redis"):
        proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False)
        assert proc.returncode != 0, f"{module} is installed without extras"


def test_the_core_install_checks_a_policy_and_names_a_missing_extra(
    core_venv: Path, tmp_path: Path
) -> None:
    example = ROOT / "policies" / "examples" / "single-backend.yaml"
    ok = run(core_venv, "check", str(example), env={"UPSTREAM_URL": "http://127.0.0.1:9/v1"})
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    cached = tmp_path / "cached.yaml"
    cached.write_text(
        "backends:\n  up: {kind: vllm, replicas: ['http://127.0.0.1:9/v1']}\n"
        "surfaces:\n  default:\n    cache: {exact: true, semantic: {}}\n"
    )
    proc = run(core_venv, "check", str(cached))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"{cached}:5: surfaces.default.cache:" in proc.stderr
    assert "pip install 'llm-gateway[cache]'" in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "llm-gateway[cache]" in line]
    assert len(lines) == 1
    shared = tmp_path / "shared.yaml"
    shared.write_text(
        "backends:\n  up: {kind: vllm, replicas: ['http://127.0.0.1:9/v1']}\n"
        "shared_state: {redis_url: 'redis://127.0.0.1:6379/0'}\n"
    )
    proc = run(core_venv, "check", str(shared))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{shared}:3: shared_state.redis_url: shared state (limits" in proc.stderr
    assert "needs the module 'redis'" in proc.stderr
    assert "pip install 'llm-gateway[shared]'" in proc.stderr


async def test_the_core_install_serves_a_request(
    core_venv: Path, make_fake: FakeFactory, tmp_path: Path
) -> None:
    up = await make_fake(models=("tiny",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"backends:\n  up: {{kind: vllm, replicas: ['{up.url}']}}\nmodels:\n  default: {{backend: up}}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        str(core_venv / "bin" / "llm-gateway"),
        "serve",
        "--policy",
        str(policy),
        "--port",
        str(port),
        cwd=str(tmp_path),
    )
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": "hi"}]
                )
                break
            except openai.APIConnectionError:
                assert proc.returncode is None, "the gateway exited"
                assert time.monotonic() < deadline, "the gateway did not start"
                await asyncio.sleep(0.3)
        assert reply.choices[0].message.content == "hello from the fake upstream"
        assert up.fake.requests[-1].body["model"] == "tiny"
    finally:
        await client.close()
        proc.terminate()
        await proc.wait()
