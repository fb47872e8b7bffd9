"""The semantic cache's policy keys: the false-hit bound, the audit, the no-generalise rules."""

from __future__ import annotations

import pytest

from policies.loader import PolicyError, parse_policy

BASE = """\
version: 1
backends:
  pool: {kind: vllm, replicas: ["http://127.0.0.1:8001/v1"]}
models:
  m: {backend: pool, model: tiny}
surfaces:
  faq:
    cache:
      exact: true
      semantic: {SEMANTIC}
      rules: {RULES}
"""


def parse(semantic: str = "{}", rules: str = "{}") -> object:
    return parse_policy(
        BASE.replace("{SEMANTIC}", semantic).replace("{RULES}", rules), "p.yaml", {}
    )


def errors(semantic: str = "{}", rules: str = "{}") -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse(semantic, rules)
    return [str(i) for i in info.value.issues]


def test_defaults_and_settings() -> None:
    policy = parse()
    cache = policy.surfaces["faq"].cache  # type: ignore[attr-defined]
    assert cache.semantic.max_false_hit_rate == 0.01
    assert cache.semantic.audit_fraction == 0.02 and cache.semantic.audit_per_minute == 30
    assert (cache.rules.tools, cache.rules.time, cache.rules.personal) == ("exact", "exact", "off")
    tuned = parse("{max_false_hit_rate: 0.05, audit_fraction: 0}", "{personal: exact, time: off}")
    c = tuned.surfaces["faq"].cache  # type: ignore[attr-defined]
    assert c.semantic.max_false_hit_rate == 0.05 and c.semantic.audit_fraction == 0
    # YAML reads a bare `off` as false: it is taken as the word.
    assert (c.rules.personal, c.rules.time) == ("exact", "off")


@pytest.mark.parametrize(
    ("semantic", "rules", "expected"),
    [
        ("{max_false_hit_rate: 0}", "{}", "surfaces.faq.cache.semantic.max_false_hit_rate"),
        ("{max_false_hit_rate: 0.9}", "{}", "surfaces.faq.cache.semantic.max_false_hit_rate"),
        ("{audit_fraction: 1.5}", "{}", "surfaces.faq.cache.semantic.audit_fraction"),
        ("{audit_fraction: -0.1}", "{}", "surfaces.faq.cache.semantic.audit_fraction"),
        ("{audit_per_minute: -1}", "{}", "surfaces.faq.cache.semantic.audit_per_minute"),
        ("{audit_min_similarity: 0}", "{}", "surfaces.faq.cache.semantic.audit_min_similarity"),
        ("{}", "{tools: sometimes}", "surfaces.faq.cache.rules.tools"),
        ("{}", "{weather: off}", "surfaces.faq.cache.rules.weather: unknown key"),
    ],
)
def test_out_of_range_settings_are_named(semantic: str, rules: str, expected: str) -> None:
    found = errors(semantic, rules)
    assert any(expected in e for e in found), found
