"""Signed thinking sealed in a Responses reasoning item and read back onto the assistant turn."""

from __future__ import annotations

from typing import Any

from gateway.protocol.responses import input_messages, read_responses_request
from gateway.protocol.responses_output import output_items
from gateway.protocol.thinking import seal, signed_blocks, unseal

SIGNED = {"type": "thinking", "thinking": "Let me think.", "signature": "sig-1"}
REDACTED = {"type": "redacted_thinking", "data": "opaque"}


def test_sealed_blocks_come_back_whole_and_nothing_else_does() -> None:
    assert unseal(seal([SIGNED, REDACTED])) == [SIGNED, REDACTED]
    for foreign in ("gAAAAABn-openai-blob", "llmgw-thinking-1:%%%", "llmgw-thinking-1:e30=", 5):
        assert unseal(foreign) == []
    # A block without a signature (vLLM's reasoning) cannot be sent back; extra fields go.
    unsigned = {"type": "thinking", "thinking": "x", "signature": ""}
    assert signed_blocks([unsigned, {**SIGNED, "cache_control": {}}, "x"]) == [SIGNED]


def test_an_answer_with_thinking_blocks_has_a_sealed_reasoning_item() -> None:
    message: Any = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Let me think.",
        "thinking_blocks": [SIGNED],
        "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
    }
    reasoning, call = output_items(message)
    assert reasoning["type"] == "reasoning" and unseal(reasoning["encrypted_content"]) == [SIGNED]
    assert call["type"] == "function_call"
    # Redacted thinking alone (no text) still has its item.
    (only, _) = output_items({"content": "hi", "thinking_blocks": [REDACTED]})
    assert only["content"] == [] and unseal(only["encrypted_content"]) == [REDACTED]
    # Reasoning without a signature (vLLM's) has no encrypted_content.
    (plain, _) = output_items({"content": "hi", "reasoning_content": "hmm"})
    assert "encrypted_content" not in plain


def test_the_blocks_go_on_the_assistant_turn_that_follows_their_item() -> None:
    request = read_responses_request(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "summary": [], "encrypted_content": seal([SIGNED])},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                # Blocks with no assistant turn after them belong to no answer: dropped.
                {"type": "reasoning", "summary": [], "encrypted_content": seal([REDACTED])},
                {"role": "user", "content": "And Rome?"},
            ],
        }
    )
    messages = input_messages(request.items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["thinking_blocks"] == [SIGNED]
    assert all("thinking_blocks" not in m for m in messages if m is not messages[1])
