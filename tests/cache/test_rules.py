"""Requests whose answers do not generalise: exact-only or not cached (cache.rules)."""

from __future__ import annotations

from typing import Any

import pytest

from cache import rules
from cache.semantic import ResponseCache
from cache.store import InMemoryStore
from policies.cache import CachePolicy, CacheRules, SemanticCacheConfig


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("What is the boiling point of water?", []),
        ("What's the weather in Boston today?", ["time"]),
        ("Who is the current CEO of Nvidia?", ["time"]),
        ("What are the latest Python releases?", ["time"]),
        ("Where is my order?", ["personal"]),
        ("What's my account balance right now?", ["time", "personal"]),
        ("What is on my calendar for Monday?", ["personal"]),
        # How-to questions about one's own things are the same for everyone.
        ("How do I change the email address on my account?", []),
        ("how to track my package", []),
        ("My kid won't eat vegetables, any tips?", []),
        ("Is it now or never?", ["time"]),
    ],
)
def test_rules_fire_on_documented_words(text: str, names: list[str]) -> None:
    assert rules.fired(body(text), text) == names


def test_tools_rule_sees_tools_and_tool_results() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert rules.fired(body("What is 2+2?", tools=[tool]), "What is 2+2?") == ["tools"]
    history = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        ]
    }
    assert rules.uses_tools(history)
    assert not rules.uses_tools(body("plain"))


def test_the_most_restrictive_mode_wins() -> None:
    r = CacheRules()
    assert rules.mode_for(r, []) == ("semantic", None)
    assert rules.mode_for(r, ["time"]) == ("exact", "time")
    assert rules.mode_for(r, ["time", "personal"]) == ("off", "personal")
    relaxed = CacheRules(time="semantic", personal="exact")
    assert rules.mode_for(relaxed, ["time"]) == ("semantic", None)
    assert rules.mode_for(relaxed, ["tools", "personal"]) == ("exact", "tools")


def test_plans_follow_the_rules() -> None:
    cache = ResponseCache(InMemoryStore(), None, dim=8)
    policy = CachePolicy(semantic=SemanticCacheConfig(gate="cosine"))

    def plan(text: str, p: CachePolicy = policy, **extra: Any) -> Any:
        return cache.plan(
            body(text, **extra), p, tenant="t", model_alias="m", surface="s", query_text=text
        )

    generic = plan("What is the boiling point of water?")
    assert generic.request is not None and generic.semantic and generic.rule is None
    timely = plan("What's the weather today?")
    assert timely.request is not None and not timely.semantic and timely.rule == "time"
    personal = plan("Where is my order?")
    assert personal.request is None and not personal.lookup and personal.rule == "personal"
    allowed = CachePolicy(semantic=SemanticCacheConfig(), rules=CacheRules(personal="semantic"))
    assert plan("Where is my order?", allowed).semantic
