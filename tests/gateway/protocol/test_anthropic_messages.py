"""Anthropic Messages requests -> chat requests, chat answers -> Messages, errors, model lists.

Answers are validated against the official anthropic SDK's own models.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message

from gateway.errors import BadRequest
from gateway.protocol.anthropic_messages import (
    effort_for_budget,
    parse_messages_request,
    read_messages_request,
)
from gateway.protocol.anthropic_messages_output import (
    error_body,
    from_chat_completion,
    from_openai_error,
    models_page,
)

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def chat_of(**body: Any) -> dict[str, Any]:
    return read_messages_request({"model": "m", "max_tokens": 64, **body}).chat


def test_system_text_and_parameters() -> None:
    chat = chat_of(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hi"}],
        stop_sequences=["END"],
        temperature=0.3,
        top_p=0.9,
        top_k=5,
        metadata={"user_id": "u-1"},
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "max_tokens": 64,
        "stop": ["END"],
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 5,
        "user": "u-1",
    }


def test_a_stream_asks_for_the_usage_chunk() -> None:
    request = read_messages_request(
        {
            "model": "m",
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert request.stream is True
    assert request.chat["stream_options"] == {"include_usage": True}


def test_tool_use_and_tool_results_become_chat_turns() -> None:
    chat = chat_of(
        messages=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no data"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Summarise."},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
        {"role": "user", "content": "Summarise."},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": "Weather in a city",
            },
        }
    ]
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    chat = chat_of(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice)
    assert chat["tool_choice"] == expected


def test_images_and_documents() -> None:
    chat = chat_of(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x/a.jpg"}},
                    {
                        "type": "document",
                        "title": "report.pdf",
                        "source": {
                            "type": "base64",
                            "media_type": "application/pdf",
                            "data": "JVBE",
                        },
                    },
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
                    },
                    {"type": "text", "text": "Compare."},
                ],
            }
        ]
    )
    assert chat["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
        {"type": "image_url", "image_url": {"url": "https://x/a.jpg"}},
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "report.pdf"},
        },
        {"type": "text", "text": "notes"},
        {"type": "text", "text": "Compare."},
    ]


def test_thinking_budget_and_output_format() -> None:
    chat = chat_of(
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "enabled", "budget_tokens": 8000},
    )
    assert chat["reasoning_effort"] == "medium"
    assert [effort_for_budget(b) for b in (1024, 4096, 16384)] == ["low", "medium", "high"]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = chat_of(
        messages=[{"role": "user", "content": "x"}],
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}},
    )
    assert chat["reasoning_effort"] == "high"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def test_count_tokens_needs_no_max_tokens() -> None:
    request = read_messages_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}, count_only=True
    )
    assert "max_tokens" not in request.chat


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "search_result", "source": "s"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "url", "url": "https://x/a.pdf"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.source",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [
                                    {"type": "image", "source": {"type": "url", "url": "u"}}
                                ],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "u"}]},
            "mcp_servers",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "bogus"}},
            "tool_choice",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        read_messages_request({"model": "m", "max_tokens": 16, **body})
    assert info.value.param == param


def test_a_body_that_is_not_json() -> None:
    with pytest.raises(BadRequest):
        parse_messages_request(b"[1, 2")


# --- answers ---------------------------------------------------------------------------------


def answer(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "served-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **extra}],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": 6,
            "total_tokens": 26,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }


def test_a_text_answer_with_cache_reads() -> None:
    data = from_chat_completion(
        answer({"role": "assistant", "content": "Hi!", "reasoning_content": "Greet."}), "alias"
    )
    message = Message.model_validate(data)
    assert message.id.startswith("msg_")
    assert message.role == "assistant" and message.model == "served-model"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].type == "text" and message.content[1].text == "Hi!"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 4  # Anthropic counts cache reads apart
    assert message.usage.cache_read_input_tokens == 16
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.output_tokens == 6


def test_tool_calls_become_tool_use_blocks() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    message = Message.model_validate(
        from_chat_completion(
            answer({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"), "m"
        )
    )
    assert message.stop_reason == "tool_use"
    blocks = [(b.type, getattr(b, "id", None), getattr(b, "input", None)) for b in message.content]
    assert blocks == [
        ("tool_use", "call_1", {"a": 1}),
        ("tool_use", "call_2", {"arguments": "not json"}),
    ]


@pytest.mark.parametrize(
    ("finish", "matched", "reason", "sequence"),
    [
        ("stop", "END", "stop_sequence", "END"),
        ("stop", None, "end_turn", None),
        ("stop", 2, "end_turn", None),  # vLLM reports a stop token id: not a stop sequence
        ("length", None, "max_tokens", None),
        ("content_filter", None, "refusal", None),
    ],
)
def test_stop_reasons(finish: str, matched: Any, reason: str, sequence: str | None) -> None:
    data = from_chat_completion(
        answer({"role": "assistant", "content": "x"}, finish, stop_reason=matched), "m", ("END",)
    )
    assert (data["stop_reason"], data["stop_sequence"]) == (reason, sequence)


def test_errors_in_anthropics_format_and_statuses() -> None:
    assert error_body(401, "bad key") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "bad key"},
    }
    raw = json.dumps({"error": {"message": "no replica", "type": "service_unavailable"}}).encode()
    status, body = from_openai_error(503, raw)
    assert status == 529
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "no replica"},
    }
    flat = b'{"object": "error", "message": "prompt is too long", "type": "BadRequestError"}'
    status, body = from_openai_error(400, flat)  # older vLLM's form: the message was lost
    assert json.loads(body)["error"]["message"] == "prompt is too long"
    status, body = from_openai_error(502, b"<html>")
    assert status == 502 and json.loads(body)["error"]["type"] == "api_error"
    for code, kind in [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (504, "timeout_error"),
    ]:
        assert error_body(code, "m")["error"]["type"] == kind


def test_models_page() -> None:
    model = {"type": "model", "created_at": "1970-01-01T00:00:00Z", "lifecycle": "active"}
    assert models_page(["a", "b"]) == {
        "data": [
            {**model, "id": "a", "display_name": "a"},
            {**model, "id": "b", "display_name": "b"},
        ],
        "has_more": False,
        "first_id": "a",
        "last_id": "b",
    }


def ids(page: dict[str, Any]) -> tuple[list[str], bool, str | None, str | None]:
    return [m["id"] for m in page["data"]], page["has_more"], page["first_id"], page["last_id"]


def test_models_are_paged_as_anthropic_pages_them() -> None:
    names = ["a", "b", "c", "d", "e"]
    assert ids(models_page(names, limit="2")) == (["a", "b"], True, "a", "b")
    assert ids(models_page(names, limit="2", after_id="b")) == (["c", "d"], True, "c", "d")
    assert ids(models_page(names, limit="2", after_id="d")) == (["e"], False, "e", "e")
    assert ids(models_page(names, after_id="e")) == ([], False, None, None)
    assert ids(models_page(names, limit="2", before_id="e")) == (["c", "d"], True, "c", "d")
    assert ids(models_page(names, limit="2", before_id="c")) == (["a", "b"], False, "a", "b")
    assert ids(models_page(names, before_id="a")) == ([], False, None, None)
    assert ids(models_page(names, lifecycles=["deprecated", "active"]))[0] == names
    assert ids(models_page(names, lifecycles=["retired"]))[0] == []
    assert len(models_page([str(i) for i in range(30)])["data"]) == 20  # Anthropic's default


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"limit": "٣"}, "limit"),  # an Arabic-Indic digit: isdigit() says yes
        ({"after_id": "z"}, "after_id"),
        ({"before_id": "z"}, "before_id"),
        ({"after_id": "a", "before_id": "b"}, "before_id"),
        ({"lifecycles": ["gone"]}, "lifecycle"),
    ],
)
def test_a_models_query_out_of_range_is_a_400_naming_it(query: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        models_page(["a", "b"], **query)
    assert info.value.param == param


def test_count_tokens_requests_and_the_estimate() -> None:
    from gateway.protocol.token_count import estimate, read_count, tokenize_body, tokenize_url

    chat = chat_of(messages=[{"role": "user", "content": "x" * 10}], system="y" * 6)
    assert tokenize_body(chat, "served", False) == {
        "model": "served",
        "messages": chat["messages"],
        "add_generation_prompt": True,
    }
    assert tokenize_url("http://h:8000/v1") == "http://h:8000/tokenize"
    assert tokenize_url("http://h:8000/v1/") == "http://h:8000/tokenize"
    assert read_count({"count": 7, "max_model_len": 9}) == 7
    assert read_count({"count": "7"}) is None and read_count([]) is None
    assert estimate(chat) == 4 + 2 * 3  # ceil(16 / 4) + 3 per message


def test_reasoning_tokens_are_thinking_tokens() -> None:
    chat_answer = answer({"role": "assistant", "content": "x"})
    chat_answer["usage"]["completion_tokens_details"] = {"reasoning_tokens": 4}
    message = Message.model_validate(from_chat_completion(chat_answer, "m"))
    assert message.usage.output_tokens_details is not None
    assert message.usage.output_tokens_details.thinking_tokens == 4
    plain = from_chat_completion(answer({"role": "assistant", "content": "x"}), "m")
    assert "output_tokens_details" not in plain["usage"]
