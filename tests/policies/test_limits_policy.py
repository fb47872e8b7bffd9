"""The policy keys of tenant limits, budgets, prices and shared state: typed, strict, and every
mistake a ``file:line: key.path: message``."""

from __future__ import annotations

from decimal import Decimal

import pytest

from policies.loader import PolicyError, parse_policy

HEAD = """backends:
  up: {kind: vllm, replicas: ["http://127.0.0.1:9/v1"]}
"""
GOOD = (
    HEAD
    + """shared_state: {redis_url: "${REDIS_URL:-}", limits_failure_mode: closed}
models:
  default:
    backend: up
    price: {input_per_mtok: 0.15, output_per_mtok: 0.60, cached_input_per_mtok: 0.075}
  lite: {backend: up, price: {input_per_mtok: 0.1, output_per_mtok: 0.2}}
tenants:
  team-a:
    api_key_sha256: ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}
    budget: {usd: 50, window: month, alert_at: [0.95, 0.5, 0.8], on_exhausted: downgrade,
             downgrade_to: lite}
surfaces:
  chat:
    limits: {requests_per_minute: 100, expected_output_tokens: 512}
"""
)


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", {})
    return [str(i) for i in info.value.issues]


def test_the_issue_keys_load_typed_and_exact() -> None:
    policy = parse_policy(GOOD, "p.yaml", {"REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert policy.shared_state.redis_url == "redis://127.0.0.1:6379/0"
    assert policy.shared_state.limits_failure_mode == "closed"
    assert policy.shared_state.timeout_ms == 500
    price = policy.models["default"].price
    assert price is not None and price.cached_input_per_mtok == Decimal("0.075")
    team = policy.tenants["team-a"]
    assert team.limits is not None and team.limits.tokens_per_minute == 200_000
    assert team.budget is not None and team.budget.usd == Decimal(50)
    assert team.budget.alert_at == [Decimal("0.5"), Decimal("0.8"), Decimal("0.95")]
    limits = policy.surfaces["chat"].limits
    assert limits is not None and limits.expected_output_tokens == 512
    empty = parse_policy(GOOD, "p.yaml", {})
    assert empty.shared_state.redis_url is None  # empty: in-process, one instance


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("requests_per_minute: 600", "requests_per_minute: 0"),
            "p.yaml:12: tenants.team-a.limits.requests_per_minute: Input should be greater than or equal to 1",
        ),
        (
            ("max_concurrent: 32", "max_concurent: 32"),
            "p.yaml:12: tenants.team-a.limits.max_concurent: unknown key",
        ),
        (
            ("output_per_mtok: 0.60", "output_per_mtok: 0.0000001"),
            "p.yaml:7: models.default.price.output_per_mtok: Decimal input should have no more than 6 decimal places",
        ),
        (
            ("alert_at: [0.95, 0.5, 0.8]", "alert_at: [1.5]"),
            "p.yaml:13: tenants.team-a.budget.alert_at: alert_at fractions must be in (0, 1]: 1.5",
        ),
        (
            ("window: month", "window: year"),
            "p.yaml:13: tenants.team-a.budget.window: Input should be 'day', 'week' or 'month'",
        ),
        (
            ("downgrade_to: lite", "downgrade_to: nope"),
            "p.yaml:14: tenants.team-a.budget.downgrade_to: no model alias named 'nope'",
        ),
        (
            ("on_exhausted: downgrade", "on_exhausted: reject"),
            "p.yaml:13: tenants.team-a.budget: downgrade_to applies to on_exhausted: downgrade only",
        ),
        (
            ("limits_failure_mode: closed", "limits_failure_mode: maybe"),
            "p.yaml:3: shared_state.limits_failure_mode: Input should be 'open' or 'closed'",
        ),
        (
            ('redis_url: "${REDIS_URL:-}"', "redis_url: http://x"),
            "p.yaml:3: shared_state.redis_url: not a redis:// URL: 'http://x'",
        ),
    ],
)
def test_mistakes_name_file_line_and_key(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in GOOD
    assert errors(GOOD.replace(old, new)) == [expected]


def test_a_budget_needs_a_priced_model() -> None:
    unpriced = GOOD.replace(
        "    price: {input_per_mtok: 0.15, output_per_mtok: 0.60, cached_input_per_mtok: 0.075}\n",
        "",
    ).replace("  lite: {backend: up, price: {input_per_mtok: 0.1, output_per_mtok: 0.2}}\n", "")
    found = errors(
        unpriced.replace(", on_exhausted: downgrade,\n             downgrade_to: lite", "")
    )
    assert found == [
        "p.yaml:11: tenants.team-a.budget: no model has a price (models.<alias>.price): nothing spends it"
    ]
