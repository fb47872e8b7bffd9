"""Requests whose answers do not generalise: exact-only or not cached (cache.rules)."""

from __future__ import annotations

from typing import Any

import pytest

from cache import rules
from cache.semantic import MAX_SEMANTIC_CHARS, ResponseCache
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
        # An emoji or symbol between "my" and the record, an invisible character anywhere.
        ("Where is my \U0001f4e6 order?", ["personal"]),
        ("Where is my\u200border?", ["personal"]),
        ("Where is my\u200b\u200border?", ["personal"]),
        ("What's my\u2060 balance?", ["personal"]),
        ("What is the weather to\u00adday?", ["time"]),
        ("How do I track my \U0001f4e6 order?", []),
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


def test_a_request_that_echoes_its_prompt_is_exact_only() -> None:
    """echo (completions, vLLM chat) and prompt_logprobs return the prompt or its scores: a
    semantic hit would return another user's prompt."""
    cache = ResponseCache(InMemoryStore(), None, dim=8)
    policy = CachePolicy(semantic=SemanticCacheConfig(gate="cosine"))
    completion = {"model": "m", "prompt": "Say hi", "temperature": 0, "echo": True}
    echoed = cache.plan(
        completion,
        policy,
        tenant="t",
        model_alias="m",
        surface="s",
        endpoint="completions",
        query_text="Say hi",
    )
    assert echoed.request is not None and echoed.lookup and not echoed.semantic
    assert echoed.rule == "echo"
    for extra in ({"echo": True}, {"prompt_logprobs": 0}, {"prompt_logprobs": 5}):
        chat = cache.plan(
            body("Say hi", **extra),
            policy,
            tenant="t",
            model_alias="m",
            surface="s",
            query_text="Say hi",
        )
        assert not chat.semantic and chat.rule == "echo", extra
    plain = cache.plan(
        body("Say hi", echo=False),
        policy,
        tenant="t",
        model_alias="m",
        surface="s",
        query_text="Say hi",
    )
    assert plain.semantic and plain.rule is None


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def translated_messages(*content: Any) -> dict[str, Any]:
    """The chat body the cache sees for a Messages request: system first, the text blocks as
    text parts (an image as an image_url part), a final assistant prefill."""
    return {
        "model": "m",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": list(content)},
            {"role": "assistant", "content": "Sure,"},
        ],
    }


@pytest.mark.parametrize(
    ("request_body", "names"),
    [
        # Text beside an image: no user's text, but the question is still the user's own.
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "my order?"}]}]},
            ["personal"],
        ),
        (
            body(
                "x",
                messages=[{"role": "user", "content": [IMAGE, text_part("Where is my order?")]}],
            ),
            ["personal"],
        ),
        (
            body("x", messages=[{"role": "user", "content": [text_part("Weather today?"), IMAGE]}]),
            ["time"],
        ),
        # Every text part counts: the record noun is in the second.
        (
            translated_messages(text_part("What is on"), text_part("my calendar?"), IMAGE),
            ["personal"],
        ),
        # A Responses request's input string becomes one plain user message.
        (body("What is my account balance right now?"), ["time", "personal"]),
        # A prompt (completions) without a user's text: a list of strings.
        ({"prompt": ["Where is my refund?"]}, ["personal"]),
        ({"prompt": [[1, 2, 3]]}, []),
        # The question, not the assistant's reply or a system prompt, is what the rules read.
        (
            {
                "messages": [
                    {"role": "system", "content": "Today is Monday."},
                    {"role": "user", "content": [text_part("How tall is Everest?"), IMAGE]},
                ]
            },
            [],
        ),
    ],
)
def test_rules_read_the_last_user_message_when_there_is_no_users_text(
    request_body: dict[str, Any], names: list[str]
) -> None:
    assert rules.fired(request_body, None) == names


def test_rules_keep_a_dialect_or_multimodal_personal_question_out_of_the_cache() -> None:
    cache = ResponseCache(InMemoryStore(), None, dim=8)
    policy = CachePolicy(semantic=SemanticCacheConfig(gate="cosine"))
    for request_body in (
        translated_messages(text_part("Where is my order?")),
        body("x", messages=[{"role": "user", "content": [text_part("Where is my order?"), IMAGE]}]),
        body("Where is my order?"),  # a Responses request: the gateway gives no user's text
    ):
        planned = cache.plan(request_body, policy, tenant="t", model_alias="m", surface="s")
        assert planned.request is None and planned.rule == "personal"
    timely = cache.plan(
        translated_messages(text_part("What is the weather today?")),
        policy,
        tenant="t",
        model_alias="m",
        surface="s",
    )
    assert timely.request is not None and not timely.semantic and timely.rule == "time"


def test_a_long_user_text_is_exact_only() -> None:
    """The embedder reads a text's first 256 tokens; past MAX_SEMANTIC_CHARS a near neighbour
    says little about the rest, so such a request is cached exactly only."""
    cache = ResponseCache(InMemoryStore(), None, dim=8)
    policy = CachePolicy(semantic=SemanticCacheConfig(gate="cosine"))
    long_text = "word " * (MAX_SEMANTIC_CHARS // 5 + 1)
    plans = [
        cache.plan(body(text), policy, tenant="t", model_alias="m", surface="s", query_text=text)
        for text in (long_text, long_text[:MAX_SEMANTIC_CHARS])
    ]
    assert plans[0].lookup and not plans[0].semantic and plans[0].rule == "long"
    assert plans[1].semantic
