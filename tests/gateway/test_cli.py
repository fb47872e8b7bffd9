"""``llm-gateway check``: the file, then what it names, as serving would load it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies" / "examples"


def test_shipped_examples_pass_check() -> None:
    env = {"TENANT_A_KEY": "tenant-a-secret", "TENANT_B_KEY": "tenant-b-secret", "PATH": ""}
    for name in ("single-backend.yaml", "tenants.yaml", "demo.yaml"):
        proc = subprocess.run(
            [sys.executable, "-m", "gateway", "check", str(EXAMPLES / name)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "OK" in proc.stdout


def test_check_exit_1_with_precise_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "backends:\n  pool:\n    kind: vllm\n    replicas: [http://a:1/v1]\nmodels:\n  m: {backend: nope}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 1
    assert f"{bad}:6: models.m.backend: no backend named 'nope'" in proc.stderr


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


TIERED = """backends:
  small: {kind: vllm, replicas: ["http://127.0.0.1:9/v1"]}
  large: {kind: openai, base_url: "http://127.0.0.1:9/v1"}
models:
  auto:
    tiers: [small, large]
    mode: cascade
    artifact: ARTIFACT
"""


def test_check_loads_the_artifact_a_tiered_alias_names(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(TIERED.replace("ARTIFACT", "/nonexistent/difficulty.json"))
    proc = check(policy)
    assert proc.returncode == 1
    assert f"{policy}:8: models.auto.artifact: cannot load the tier artifact" in proc.stderr
    assert "Traceback" not in proc.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "llm-gateway/tier-router/v1", "domains": []}')
    policy.write_text(TIERED.replace("ARTIFACT", str(broken)))
    proc = check(policy)
    assert proc.returncode == 1 and "models.auto.artifact" in proc.stderr
    shipped = ROOT / "routing" / "artifacts" / "difficulty.json"
    policy.write_text(TIERED.replace("ARTIFACT", str(shipped)))
    assert check(policy).returncode == 0


def test_check_loads_the_tokenizer_of_precise_routing(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{not a tokenizer")
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "backends:\n"
        "  pool:\n"
        "    kind: vllm\n"
        '    replicas: ["http://127.0.0.1:9/v1"]\n'
        f"    routing: {{strategy: prefix_precise, tokenizer: {tokenizer}}}\n"
    )
    proc = check(policy)
    assert proc.returncode == 1
    assert f"{policy}:5: backends.pool.routing: tokenizer" in proc.stderr


def test_limits_across_workers_need_shared_state(tmp_path: Path) -> None:
    """N workers counting in their own memory would admit N times a limit: refused."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "backends:\n  up: {kind: vllm, replicas: ['http://127.0.0.1:9/v1']}\n"
        "models:\n  m: {backend: up}\n"
        "tenants:\n  a:\n    api_key_sha256: ['" + "0" * 64 + "']\n"
        "    limits: {requests_per_minute: 10}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--workers", "2",
         "--port", "9"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "need shared_state.redis_url" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unexpected_build_error_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    """`check` and `serve` report what the build raised (here the JSON reader's RecursionError,
    which the artifact loader does not expect) as one more problem of the file."""
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000)
    policy = tmp_path / "p.yaml"
    policy.write_text(TIERED.replace("ARTIFACT", str(nested)))
    proc = check(policy)
    assert proc.returncode == 1
    assert "cannot build the policy's runtime: RecursionError" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--workers", "1"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "invalid policy, not starting" in proc.stderr and "RecursionError" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_counts_every_problem_and_lists_twenty(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    models = "".join(f"  m{i}: {{backend: nope}}\n" for i in range(30))
    bad.write_text(
        "backends:\n  pool:\n    kind: vllm\n    replicas: [http://a:1/v1]\nmodels:\n" + models
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    lines = proc.stderr.splitlines()
    # Before: the header said 21 (the 20 listed and the line counting the rest).
    assert lines[0].endswith("invalid policy (30 problem(s))"), lines[0]
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  and 10 more problem(s)"


def test_check_notes_route_detail_headers(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    backends = "backends: {pool: {kind: vllm, replicas: ['http://127.0.0.1:9/v1']}}\n"
    policy.write_text(f"server: {{route_detail_headers: true}}\n{backends}")
    proc = check(policy)
    assert proc.returncode == 0, proc.stderr
    assert "note: server.route_detail_headers" in proc.stdout
    policy.write_text(f"server: {{route_detail_headers: yes please}}\n{backends}")
    proc = check(policy)
    assert proc.returncode == 1
    assert f"{policy}:1: server.route_detail_headers" in proc.stderr
    policy.write_text(backends)
    proc = check(policy)
    assert proc.returncode == 0 and "note:" not in proc.stdout
