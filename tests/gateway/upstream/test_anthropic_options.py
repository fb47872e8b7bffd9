"""Structured output, thinking, PDF documents and cache markers on Anthropic backends, both ways."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.upstream.providers.anthropic_options import MIN_ANSWER_TOKENS, format_tool_name
from gateway.upstream.providers.anthropic_request import to_messages_request
from gateway.upstream.providers.anthropic_response import chat_completion
from gateway.upstream.providers.anthropic_stream import AnthropicStream

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "City", "schema": SCHEMA, "strict": True},
}
USER: Any = {"role": "user", "content": "Capital of France?"}
TOOL: Any = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def translate(**body: Any) -> dict[str, Any]:
    return to_messages_request({"model": "m", "messages": [USER], **body}, "claude", 1000)


def test_json_schema_is_a_forced_tool() -> None:
    out = translate(response_format=FORMAT)
    assert out["tools"] == [
        {
            "name": "City",
            "description": "Give the final answer as this tool's input.",
            "input_schema": SCHEMA,
        }
    ]
    assert out["tool_choice"] == {"type": "tool", "name": "City"}


def test_with_the_clients_own_tools_the_model_may_call_any() -> None:
    out = translate(response_format=FORMAT, tools=[TOOL])
    assert [t["name"] for t in out["tools"]] == ["lookup", "City"]
    assert out["tool_choice"] == {"type": "any"}
    clash = {**FORMAT, "json_schema": {**FORMAT["json_schema"], "name": "lookup"}}
    assert format_tool_name({"response_format": clash, "tools": [TOOL]}) == "lookup_output"


def test_json_object_is_an_open_schema() -> None:
    out = translate(response_format={"type": "json_object"})
    assert out["tools"][0]["name"] == "json_output"
    assert out["tools"][0]["input_schema"] == {"type": "object"}


def test_reasoning_effort_is_a_thinking_budget_added_to_the_default_max_tokens() -> None:
    out = translate(reasoning_effort="medium")
    assert out["thinking"] == {"type": "enabled", "budget_tokens": 8192}
    assert out["max_tokens"] == 1000 + 8192  # the backend's default room for the answer, + budget
    assert "thinking" not in translate(reasoning_effort="none")
    with pytest.raises(BadRequest) as info:
        translate(reasoning_effort="medium", temperature=0.2)
    assert info.value.param == "temperature"
    with pytest.raises(BadRequest) as info:
        translate(reasoning_effort="huge")
    assert info.value.param == "reasoning_effort"


def test_a_limit_bounds_thinking_and_answer_together() -> None:
    """The client's limit (OpenAI counts reasoning in ``max_completion_tokens``) or the
    gateway's output cap is never exceeded: the budget shrinks to leave room for an answer,
    and below Anthropic's least budget thinking is left off."""
    roomy = translate(reasoning_effort="medium", max_completion_tokens=20000)
    assert (roomy["max_tokens"], roomy["thinking"]["budget_tokens"]) == (20000, 8192)
    shrunk = translate(reasoning_effort="high", max_tokens=5000)
    assert shrunk["max_tokens"] == 5000
    assert shrunk["thinking"]["budget_tokens"] == 5000 - MIN_ANSWER_TOKENS
    least = translate(reasoning_effort="low", max_completion_tokens=1024 + MIN_ANSWER_TOKENS)
    assert least["thinking"]["budget_tokens"] == 1024
    small = translate(reasoning_effort="low", max_completion_tokens=1023 + MIN_ANSWER_TOKENS)
    assert "thinking" not in small and small["max_tokens"] == 1023 + MIN_ANSWER_TOKENS
    body = {"model": "m", "messages": [USER], "reasoning_effort": "high"}
    capped = to_messages_request(body, "claude", 1000, cap=234)  # cap_output's, for total_ms
    assert capped["max_tokens"] == 234 and "thinking" not in capped
    capped = to_messages_request(body, "claude", 1000, cap=3000)
    assert (capped["max_tokens"], capped["thinking"]["budget_tokens"]) == (3000, 2744)


def test_thinking_with_structured_output_asks_instead_of_forcing() -> None:
    out = translate(reasoning_effort="low", response_format=FORMAT)
    assert out["tool_choice"] == {"type": "auto"}  # Anthropic refuses a forced tool with thinking
    assert "City" in out["system"][-1]["text"]


def test_pdf_parts_and_cache_markers() -> None:
    marker = {"type": "ephemeral"}
    message = {
        "role": "user",
        "content": [
            {
                "type": "file",
                "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "r.pdf"},
            },
            {"type": "text", "text": "Summarise.", "cache_control": marker},
        ],
    }
    system = {
        "role": "system",
        "content": [{"type": "text", "text": "Long.", "cache_control": marker}],
    }
    out = to_messages_request({"model": "m", "messages": [system, message]}, "claude", 100)
    assert out["system"] == [{"type": "text", "text": "Long.", "cache_control": marker}]
    assert out["messages"][0]["content"] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
            "title": "r.pdf",
        },
        {"type": "text", "text": "Summarise.", "cache_control": marker},
    ]
    bad = {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}
    with pytest.raises(BadRequest) as info:
        to_messages_request({"model": "m", "messages": [bad]}, "claude", 100)
    assert info.value.param == "messages[0].content[0].file"


def test_the_answer_in_the_format_tool_is_the_content() -> None:
    message = {
        "type": "message",
        "model": "claude",
        "content": [
            {"type": "thinking", "thinking": "France.", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "City", "input": {"city": "Paris"}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    answer = chat_completion(message, format_tool="City")
    choice = answer["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"city": "Paris"}
    assert choice["message"]["reasoning_content"] == "France."
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    plain = chat_completion(message)  # without a format tool it is an ordinary tool call
    assert plain["choices"][0]["finish_reason"] == "tool_calls"


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def test_a_streamed_structured_answer_is_streamed_content() -> None:
    stream = AnthropicStream(False, "m", "City")
    data = sse(
        {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "usage": {}}},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "Hm."},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "s"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "City", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": '},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 5},
        },
        {"type": "message_stop"},
    )
    out = stream.feed(data)
    chunks = [json.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == '{"city": "Paris"}'
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Hm."
    assert not any("tool_calls" in d for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert out.endswith(b"data: [DONE]\n\n")


def test_thinking_tokens_come_back_as_reasoning_tokens() -> None:
    message = {
        "type": "message",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 3,
            "output_tokens": 9,
            "cache_read_input_tokens": 4,
            "output_tokens_details": {"thinking_tokens": 5},
        },
    }
    usage = chat_completion(message)["usage"]
    assert usage["prompt_tokens"] == 7 and usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}
