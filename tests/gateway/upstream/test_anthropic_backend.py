"""``kind: anthropic`` in the policy: what loads, what is refused (file:line: key), what it builds."""

from __future__ import annotations

import pytest

from gateway.build import prepare
from gateway.observability.tracing import Telemetry
from gateway.runtime import Resources, Runtime
from gateway.upstream.providers.anthropic import AnthropicProvider
from policies.backends import AnthropicBackend
from policies.loader import PolicyError, PolicySource, parse_policy

GOOD = """\
version: 1
backends:
  pool:
    kind: vllm
    replicas: ["http://127.0.0.1:8001/v1"]
  claude:
    kind: anthropic
    api_key_env: TEST_ANTHROPIC_KEY
    default_max_tokens: 1024
    timeouts: {first_byte_s: 30}
models:
  smart:
    backend: claude
    model: claude-sonnet-4-5
    fallbacks: [pool]
  small: {backend: pool, fallbacks: [{backend: claude, model: claude-haiku-4-5}]}
"""
ENV = {"TEST_ANTHROPIC_KEY": "sk-ant-x"}


def errors(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", ENV if env is None else env)
    return [str(i) for i in info.value.issues]


def test_anthropic_backend_loads_with_its_defaults() -> None:
    backend = parse_policy(GOOD, "p.yaml", ENV).backends["claude"]
    assert isinstance(backend, AnthropicBackend)
    assert backend.base_url == "https://api.anthropic.com/v1"
    assert backend.default_max_tokens == 1024
    assert backend.health.active is False
    assert backend.timeouts.first_byte_s == 30
    assert backend.discover_models is False
    minimal = parse_policy(
        "backends:\n  c: {kind: anthropic, base_url: 'http://127.0.0.1:9/v1/', "
        "health: {eject_after: 5}}\nmodels:\n  m: {backend: c}\n",
        "p.yaml",
        {},
    ).backends["c"]
    assert isinstance(minimal, AnthropicBackend)
    assert minimal.base_url == "http://127.0.0.1:9/v1"
    assert minimal.default_max_tokens == 4096
    assert (minimal.health.active, minimal.health.eject_after) == (False, 5)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("    api_key_env:", "    replicas: []\n    api_key_env:"),
            "p.yaml:8: backends.claude.replicas: unknown key",
        ),
        (
            ("    default_max_tokens: 1024", "    default_max_tokens: 0"),
            "p.yaml:9: backends.claude.default_max_tokens: Input should be greater than or equal to 1",
        ),
        (
            ("    timeouts:", "    health: {active: true}\n    timeouts:"),
            "p.yaml:10: backends.claude.health: anthropic backends have no health endpoint",
        ),
        (
            ("    kind: anthropic", "    kind: claude"),
            "p.yaml:6: backends.claude: unknown kind 'claude' (expected vllm, openai or anthropic)",
        ),
        (
            ("    api_key_env:", "    base_url: not-a-url\n    api_key_env:"),
            "p.yaml:8: backends.claude.base_url: not an http(s) URL",
        ),
    ],
)
def test_bad_anthropic_backends_name_file_line_and_key(
    change: tuple[str, str], expected: str
) -> None:
    old, new = change
    assert old in GOOD
    found = errors(GOOD.replace(old, new, 1))
    assert any(e.startswith(expected) for e in found), found


def test_the_key_variable_must_be_set() -> None:
    found = errors(GOOD, env={})
    assert found == [
        "p.yaml:8: backends.claude.api_key_env: environment variable TEST_ANTHROPIC_KEY is not set"
    ]


def test_runtime_gives_anthropic_targets_a_provider_and_one_passive_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-x")
    policy = parse_policy(GOOD, "p.yaml", ENV)
    source = PolicySource("p.yaml")
    resources = Resources(None, None, Telemetry.disabled(), owns_telemetry=False)
    rt = Runtime(policy, source, prepare(policy, source).pools, resources)
    smart, fallback = rt.targets("smart")
    assert isinstance(smart.provider, AnthropicProvider)
    assert smart.provider.headers["x-api-key"] == "sk-ant-x"
    assert smart.upstream_model == "claude-sonnet-4-5"
    assert fallback.provider is None  # vLLM is sent the client's bytes untouched
    small, to_claude = rt.targets("small")
    assert small.provider is None and isinstance(to_claude.provider, AnthropicProvider)
    pool = rt.pools["claude"]
    assert [r.base_url for r in pool.replicas] == ["https://api.anthropic.com/v1"]
    assert pool.replicas[0].healthy  # no active checks: it takes traffic at once
    assert pool.settings.kind == "anthropic" and not pool.settings.active_health
