"""The one rule for "the user's text" (gateway.protocol.openai.user_text)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.protocol.openai import Endpoint, parse_request, user_text


def chat(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages)}


SYSTEM = {"role": "system", "content": "Be terse."}


def test_the_last_user_message_is_the_users_text() -> None:
    assert user_text(Endpoint.CHAT, chat(SYSTEM, {"role": "user", "content": "Hi?"})) == "Hi?"
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert user_text(Endpoint.CHAT, chat(parts)) == "a\nb"
    named = {"role": "user", "name": "ann", "content": "Hi?"}
    assert user_text(Endpoint.CHAT, chat(named)) == "Hi?"


@pytest.mark.parametrize(
    "last",
    [
        {"role": "tool", "tool_call_id": "c1", "content": "42"},  # a tool result answers nothing
        {"role": "assistant", "content": "Hello"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        },
        {"role": "user", "content": "   "},
        {"role": "user", "content": "Hi", "tool_calls": []},  # fields beyond role/content/name
    ],
)
def test_no_users_text_when_the_last_message_is_not_plain_user_text(last: dict[str, Any]) -> None:
    earlier = {"role": "user", "content": "An earlier question"}
    assert user_text(Endpoint.CHAT, chat(SYSTEM, earlier, last)) is None


def test_completions_prompt_and_parsed_requests() -> None:
    assert user_text(Endpoint.COMPLETIONS, {"model": "m", "prompt": "Once"}) == "Once"
    assert user_text(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}) is None
    assert user_text(Endpoint.EMBEDDINGS, {"model": "m", "input": "x"}) is None
    parsed = parse_request(
        Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "Q"}]}'
    )
    assert parsed.user_text == "Q"
