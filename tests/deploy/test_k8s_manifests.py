"""deploy/k8s as a pod would run it, on loopback: the ConfigMap's policy served as the
Deployment serves it (every interface, the admin token from the Secret's variable), and the
policy-reloader sidecar's own script (taken from the manifest) applying an edit of the file."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import FakeFactory

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TOKEN = "test-admin-token-0123456789"


def _manifest(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_probes_and_the_admin_token_agree_with_the_policy() -> None:
    (deployment,) = _manifest("gateway-deployment.yaml")
    gateway, reloader = deployment["spec"]["template"]["spec"]["containers"]
    # readiness must not follow shared backends: every pod would leave the Service at once
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/healthz"
    (configmap,) = _manifest("policy-configmap.yaml")
    policy = yaml.safe_load(configmap["data"]["policy.yaml"])
    token_env = policy["server"]["admin_token_env"]
    for container in (gateway, reloader):
        secret = {e["name"]: e for e in container["env"]}[token_env]
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "llm-gateway-admin", "key": "token"}
    assert policy["shared_state"]["redis_url"] == "${REDIS_URL:-}"  # every worker's Responses


async def test_the_sidecar_reloads_a_gateway_listening_beyond_loopback(
    make_fake: FakeFactory, tmp_path: Path
) -> None:
    up = await make_fake()
    (configmap,) = _manifest("policy-configmap.yaml")
    policy = yaml.safe_load(configmap["data"]["policy.yaml"])
    policy["backends"]["pool"]["replicas"] = [up.url]
    policy["backends"]["pool"]["discover_models"] = False
    policy["telemetry"]["enabled"] = False
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    (deployment,) = _manifest("gateway-deployment.yaml")
    script = deployment["spec"]["template"]["spec"]["containers"][1]["command"][2]
    port = _free_port()
    env = {**os.environ, "ADMIN_TOKEN": TOKEN, "REDIS_URL": ""}
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--host", "0.0.0.0",
        "--port", str(port), "--workers", "1", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    sidecar = None
    try:
        root = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(root + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            sidecar = await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                env={**env, "POLICY_FILE": str(path), "RELOAD_URL": root + "/admin/reload",
                     "POLL_SECONDS": "0.2"},
            )  # fmt: skip
            assert sidecar.stdout is not None
            assert b"watching" in await asyncio.wait_for(sidecar.stdout.readline(), 30)
            policy["models"]["extra"] = {"backend": "pool"}
            path.write_text(yaml.safe_dump(policy))
            line = await asyncio.wait_for(sidecar.stdout.readline(), 30)
            assert line.startswith(b"reloaded:"), line
            async with s.get(root + "/v1/models") as r:
                ids = {m["id"] for m in (await r.json())["data"]}
            assert {"default", "extra"} <= ids
            policy["models"]["broken"] = {"backend": "nope"}  # rejected: the old policy stays
            path.write_text(yaml.safe_dump(policy))
            line = await asyncio.wait_for(sidecar.stdout.readline(), 30)
            assert line.startswith(b"policy rejected, the running one stays"), line
            assert b"no backend named 'nope'" in line
    finally:
        for proc in (sidecar, gateway):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                await proc.wait()


class _Stop(Exception):
    pass


def test_the_sidecar_applies_a_file_only_once_two_polls_read_it_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ConfigMap is swapped in by a rename, but a file edited in place can be read half
    written: the sidecar reloads only what two polls in a row read the same."""
    (deployment,) = _manifest("gateway-deployment.yaml")
    script = deployment["spec"]["template"]["spec"]["containers"][1]["command"][2]
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\n")
    # What the file holds at each poll: half written, then complete, then left alone.
    polls = iter(["version: 1\nbackends:\n  po", "version: 1\nbackends: {}\n", None, None])
    applied: list[str] = []

    def sleep(_: float) -> None:
        step = next(polls, _Stop)
        if step is _Stop:
            raise _Stop
        if isinstance(step, str):
            path.write_text(step)

    class Answer:
        def __enter__(self) -> Answer:
            applied.append(path.read_text())
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def read(self) -> bytes:
            return b"{}"

    monkeypatch.setenv("POLICY_FILE", str(path))
    monkeypatch.setenv("ADMIN_TOKEN", TOKEN)
    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *_, **__: Answer())
    with pytest.raises(_Stop):
        exec(script, {"__name__": "sidecar"})
    assert applied == ["version: 1\nbackends: {}\n"]
