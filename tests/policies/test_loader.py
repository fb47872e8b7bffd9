"""The policy loader: good files load; each kind of bad file names file, line and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.backends import OpenAIBackend, VllmBackend
from policies.loader import PolicyError, load_policy, parse_policy
from policies.models import ModelRoute

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies/examples"

GOOD = """\
version: 1
server:
  max_body_bytes: ${MAX_BODY:-8192}
backends:
  pool:
    kind: vllm
    replicas: ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1/"]
  ext:
    kind: openai
    base_url: https://api.example.com/v1
    api_key_env: TEST_EXT_KEY
models:
  small: {backend: pool, model: tiny}
  large:
    backend: ext
    model: gpt-big
    fallbacks: [pool, {backend: pool, model: tiny}]
tenants:
  a: {api_keys: ["${KEY_A}"]}
surfaces:
  voice:
    match: {header: voice, tenants: [a]}
    budget: {ttft_ms: 300, itl_ms: 40, total_ms: 5000, percentile: p99}
"""

ENV = {"KEY_A": "secret-key-a", "TEST_EXT_KEY": "x"}


def errors(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", {**ENV, **(env or {})})
    return [str(i) for i in info.value.issues]


def test_good_policy_loads_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_EXT_KEY", "x")
    p = parse_policy(GOOD, "p.yaml", ENV)
    assert p.server.max_body_bytes == 8192  # substituted default, typed as int
    pool = p.backends["pool"]
    assert isinstance(pool, VllmBackend)
    assert pool.replicas[1] == "http://127.0.0.1:8002/v1"
    assert isinstance(p.backends["ext"], OpenAIBackend)
    large = p.models["large"]
    assert isinstance(large, ModelRoute)
    assert [t.backend for t in large.fallbacks] == ["pool", "pool"]
    assert p.tenants["a"].api_keys == ["secret-key-a"]
    assert p.surfaces["voice"].budget.percentile == 99.0


def test_an_openai_backends_health_block_keeps_active_checks_off_unless_asked() -> None:
    """A block that only tunes ejection must not turn on /health checks, which most
    OpenAI-compatible APIs do not answer (the backend would never be ready)."""
    text = """backends:
  ext: {kind: openai, base_url: "https://api.example.com/v1", health: HEALTH}
models: {m: {backend: ext}}
"""
    tuned = parse_policy(text.replace("HEALTH", "{eject_after: 5}"), "p.yaml", {})
    ext = tuned.backends["ext"]
    assert (ext.health.active, ext.health.eject_after) == (False, 5)
    asked = parse_policy(text.replace("HEALTH", "{active: true}"), "p.yaml", {})
    assert asked.backends["ext"].health.active is True
    pool = parse_policy(
        'backends: {p: {kind: vllm, replicas: ["http://127.0.0.1:1/v1"], '
        "health: {eject_after: 5}}}\nmodels: {m: {backend: p}}\n",
        "p.yaml",
        {},
    )
    assert pool.backends["p"].health.active is True  # vLLM serves /health: on by default


def test_env_value_overrides_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_EXT_KEY", "x")
    assert parse_policy(GOOD, "p.yaml", {**ENV, "MAX_BODY": "4096"}).server.max_body_bytes == 4096


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("    kind: vllm\n", "    kind: vllm\n    replica: []\n"),
            "p.yaml:7: backends.pool.replica: unknown key",
        ),
        (("version: 1\n", "version: 1\nextra: true\n"), "p.yaml:2: extra: unknown key"),
        (
            ("    kind: openai\n", "    kind: azure\n"),
            "p.yaml:8: backends.ext: unknown kind 'azure'",
        ),
        (
            ("max_body_bytes: ${MAX_BODY:-8192}", "max_body_bytes: lots"),
            "p.yaml:3: server.max_body_bytes: Input should be a valid integer",
        ),
        (
            ("ttft_ms: 300", "ttft_ms: 6000"),
            "p.yaml:23: surfaces.voice.budget.ttft_ms: ttft_ms (6000) exceeds total_ms (5000)",
        ),
        (
            ("itl_ms: 40", "itl_ms: 9000"),
            "p.yaml:23: surfaces.voice.budget.itl_ms: itl_ms (9000) exceeds total_ms (5000)",
        ),
        (
            ("small: {backend: pool", "small: {backend: poool"),
            "p.yaml:13: models.small.backend: no backend named 'poool'",
        ),
        (
            ("fallbacks: [pool,", "fallbacks: [nowhere,"),
            "p.yaml:17: models.large.fallbacks[0]: no backend named 'nowhere'",
        ),
        (
            ("tenants: [a]", "tenants: [b]"),
            "p.yaml:22: surfaces.voice.match.tenants[0]: no tenant named 'b'",
        ),
        (
            ('["${KEY_A}"]', '["literal-secret"]'),
            "p.yaml:19: tenants.a.api_keys[0]: plaintext API key in the file",
        ),
        (
            ('["${KEY_A}"]', '["${NOT_SET_ANYWHERE}"]'),
            "p.yaml:19: tenants.a.api_keys[0]: environment variable NOT_SET_ANYWHERE is not set",
        ),
        (
            ("percentile: p99", "percentile: 120"),
            "p.yaml:23: surfaces.voice.budget.percentile: Input should be less than 100",
        ),
        (
            ('"http://127.0.0.1:8001/v1",', '"ftp://x",'),
            "p.yaml:7: backends.pool.replicas[0]: not an http(s) URL: 'ftp://x'",
        ),
        (  # a block list: the bad item's own line (before: the line of ``replicas:``)
            (
                'replicas: ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1/"]',
                "replicas:\n      - http://127.0.0.1:8001/v1\n      - http://127.0.0.1:99999/v1",
            ),
            "p.yaml:9: backends.pool.replicas[1]: not a usable URL: "
            "'http://127.0.0.1:99999/v1' (Port out of range 0-65535)",
        ),
        (
            ("  small:", "  large: {backend: pool}\n  small:"),
            "p.yaml:15: models.large: duplicate key",
        ),
        (
            ("    kind: vllm\n", "    kind: vllm\n    http_client: httpx\n"),
            "p.yaml:7: backends.pool.http_client: Input should be 'lean' or 'aiohttp'",
        ),
        (
            ("    kind: openai\n", "    kind: openai\n    http_client: lean\n"),
            "p.yaml:10: backends.ext.http_client: unknown key",
        ),
        (("    kind: vllm\n", ""), "p.yaml:5: backends.pool: missing key 'kind'"),
        (("version: 1\n", "version: [1\n"), "p.yaml:2: invalid YAML"),
        (("version: 1\n", "version: 2\n"), "p.yaml:1: version: Input should be 1"),
    ],
)
def test_bad_policies_name_file_line_and_key(
    change: tuple[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_EXT_KEY", "x")
    old, new = change
    assert old in GOOD
    found = errors(GOOD.replace(old, new, 1))
    assert any(e.startswith(expected) for e in found), found


def test_missing_required_key_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    found = errors("backends:\n  pool: {kind: vllm}\nmodels: {m: {backend: pool}}\n")
    assert found == ["p.yaml:2: backends.pool.replicas: required key is missing"]


def test_api_key_env_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(GOOD, "p.yaml", {"KEY_A": "secret-key-a"})
    found = [str(i) for i in info.value.issues]
    assert (
        "p.yaml:11: backends.ext.api_key_env: environment variable TEST_EXT_KEY is not set" in found
    )


def test_empty_and_non_mapping_files() -> None:
    assert errors("")[0].startswith("p.yaml:")
    assert errors("- a\n- b\n") == ["p.yaml:1: the policy must be a mapping of sections"]


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "missing.yaml")
    assert "cannot read" in str(info.value)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (  # a replica named by its URL everywhere: the password went to headers and /metrics
            '"http://127.0.0.1:8001/v1",',
            '"http://bob:URLPASS@127.0.0.1:8001/v1",',
            "p.yaml:7: backends.pool.replicas[0]: credentials in a URL ('http://***@127.0.0.1",
        ),
        (
            "base_url: https://api.example.com/v1",
            "base_url: https://bob:URLPASS@api.example.com/v1",
            "p.yaml:10: backends.ext.base_url: credentials in a URL",
        ),
        (
            '"http://127.0.0.1:8001/v1",',
            '"htp://bob:URLPASS@127.0.0.1:8001/v1",',
            "p.yaml:7: backends.pool.replicas[0]: not an http(s) URL: 'htp://***@",
        ),
        (  # a key put where its digest belongs
            'a: {api_keys: ["${KEY_A}"]}',
            'a: {api_key_sha256: ["${KEY_A}"]}',
            "p.yaml:19: tenants.a.api_key_sha256: not a lowercase hex sha256 digest",
        ),
        (
            "version: 1\n",
            "version: 1\nshared_state: {redis_url: 'redsi://u:URLPASS@h:6379'}\n",
            "p.yaml:2: shared_state.redis_url: not a redis:// URL: 'redsi://***@h",
        ),
    ],
)
def test_a_bad_value_that_may_hold_a_secret_is_never_printed(
    old: str, new: str, expected: str
) -> None:
    assert old in GOOD
    found = errors(GOOD.replace(old, new, 1))
    assert any(e.startswith(expected) for e in found), found
    assert not [e for e in found if "URLPASS" in e or ENV["KEY_A"] in e], found
