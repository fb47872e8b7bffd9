"""OpenAI chat requests translated into Anthropic Messages requests, and what answers 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.protocol.openai import Endpoint, parse_request
from gateway.upstream.providers.anthropic import AnthropicProvider
from gateway.upstream.providers.anthropic_request import to_messages_request


def translate(body: dict[str, Any], cap: int | None = None) -> dict[str, Any]:
    return to_messages_request(body, "claude-test", 4096, cap)


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


USER: dict[str, Any] = {"role": "user", "content": "hi"}


def test_system_and_developer_messages_go_to_the_top_level_system() -> None:
    out = translate(
        chat(
            {"role": "system", "content": "Be brief."},
            USER,
            {"role": "developer", "content": [{"type": "text", "text": "No emoji."}]},
        )
    )
    assert out["system"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "No emoji."},
    ]
    assert out["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert out["model"] == "claude-test"
    assert "system" not in translate(chat(USER))


def test_max_tokens_default_client_value_and_cap() -> None:
    assert translate(chat(USER))["max_tokens"] == 4096
    assert translate(chat(USER, max_tokens=10))["max_tokens"] == 10
    assert translate(chat(USER, max_tokens=10, max_completion_tokens=20))["max_tokens"] == 20
    assert translate(chat(USER, max_tokens=100), cap=30)["max_tokens"] == 30
    assert translate(chat(USER), cap=30)["max_tokens"] == 30
    assert translate(chat(USER, max_tokens=5), cap=30)["max_tokens"] == 5
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, max_tokens=0))
    assert info.value.param == "max_tokens"


def test_sampling_stop_user_and_stream() -> None:
    out = translate(
        chat(USER, temperature=0.5, top_p=0.9, stop="END", user="u-42", stream=True, seed=3)
    )
    assert (out["temperature"], out["top_p"], out["stop_sequences"]) == (0.5, 0.9, ["END"])
    assert out["metadata"] == {"user_id": "u-42"}
    assert out["stream"] is True
    assert "seed" not in out  # dropped: best effort in OpenAI's API too
    assert translate(chat(USER, stop=["a", "b"]))["stop_sequences"] == ["a", "b"]
    plain = translate(chat(USER, stream=False, stream_options={"include_usage": True}))
    assert set(plain) == {"model", "max_tokens", "messages"}


def test_images_data_url_and_http_url() -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
    ]
    blocks = translate(chat({"role": "user", "content": content}))["messages"][0]["content"]
    assert blocks == [
        {"type": "text", "text": "What is this?"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]
    for bad in ("data:image/png,rawbytes", "data:image/tiff;base64,AAAA", "ftp://x/y.png"):
        part = {"type": "image_url", "image_url": {"url": bad}}
        with pytest.raises(BadRequest) as info:
            translate(chat({"role": "user", "content": [part]}))
        assert info.value.param == "messages[0].content[0].image_url"


def test_tool_round_trip_history() -> None:
    body = chat(
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "24C"}]},
        {"role": "user", "content": "Thanks. Which is warmer?"},
    )
    messages = translate(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}},
    ]
    # Both results and the next user text merged into one user turn, results first.
    assert messages[2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "call_1",
            "content": [{"type": "text", "text": "18C"}],
        },
        {
            "type": "tool_result",
            "tool_use_id": "call_2",
            "content": [{"type": "text", "text": "24C"}],
        },
        {"type": "text", "text": "Thanks. Which is warmer?"},
    ]


def test_bad_tool_call_arguments_name_the_field() -> None:
    # Not JSON; and JSON nested past json.loads's stack (a RecursionError, once a 500).
    for arguments in ("{not json", '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}"):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        with pytest.raises(BadRequest) as info:
            translate(chat(USER, {"role": "assistant", "tool_calls": [call]}))
        assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, {"role": "tool", "content": "x"}))
    assert info.value.param == "messages[1].tool_call_id"


def test_tools_and_tool_choice() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    out = translate(chat(USER, tools=tools))
    assert out["tools"] == [
        {
            "name": "weather",
            "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {"name": "now", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert "tool_choice" not in out
    choices = {
        "auto": {"type": "auto"},
        "none": {"type": "none"},
        "required": {"type": "any"},
    }
    for openai_choice, expected in choices.items():
        assert translate(chat(USER, tools=tools, tool_choice=openai_choice))["tool_choice"] == (
            expected
        )
    named = {"type": "function", "function": {"name": "now"}}
    assert translate(chat(USER, tools=tools, tool_choice=named))["tool_choice"] == {
        "type": "tool",
        "name": "now",
    }
    serial = translate(chat(USER, tools=tools, parallel_tool_calls=False))
    assert serial["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, tools=tools, tool_choice="sometimes"))
    assert info.value.param == "tool_choice"
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, tools=[{"type": "code_interpreter"}]))
    assert info.value.param == "tools[0].type"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "grammar", "grammar": "x"}}, "response_format"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"temperature": 1.5}, "temperature"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_fields_anthropic_cannot_honour_are_400_naming_the_param(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, **fields))
    assert info.value.param == param
    assert info.value.status == 400
    assert "Anthropic" in info.value.message


def test_harmless_defaults_pass() -> None:
    out = translate(
        chat(
            USER,
            n=1,
            logprobs=False,
            presence_penalty=0,
            frequency_penalty=0.0,
            response_format={"type": "text"},
        )
    )
    assert out["messages"][0]["role"] == "user"


def test_unsupported_parts_and_roles() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(BadRequest) as info:
        translate(chat({"role": "user", "content": [audio]}))
    assert info.value.param == "messages[0].content[0]"
    with pytest.raises(BadRequest) as info:
        translate(chat(USER, {"role": "function", "name": "f", "content": "x"}))
    assert info.value.param == "messages[1].role"


def test_empty_assistant_turns_are_left_out_and_same_roles_merge() -> None:
    out = translate(
        chat(USER, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"})
    )
    assert out["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "again"}],
        }
    ]


def test_provider_builds_the_body_and_refuses_other_endpoints() -> None:
    provider = AnthropicProvider("claude", "sk-test", 1000)
    assert provider.headers["x-api-key"] == "sk-test"
    assert provider.headers["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in provider.headers
    parsed = parse_request(Endpoint.CHAT, json.dumps(chat(USER)).encode())
    sent = json.loads(provider.body(parsed, "claude-x", None))
    assert (sent["model"], sent["max_tokens"]) == ("claude-x", 1000)
    for endpoint, body in (
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi"}),
        (Endpoint.EMBEDDINGS, {"model": "m", "input": "hi"}),
    ):
        with pytest.raises(BadRequest) as info:
            provider.body(parse_request(endpoint, json.dumps(body).encode()), "claude-x", None)
        assert "answers chat, Responses and Messages requests" in info.value.message
    assert "x-api-key" not in AnthropicProvider("claude", None, 1000).headers


CALL: dict[str, Any] = {
    "id": "toolu_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
SIGNED: dict[str, Any] = {"type": "thinking", "thinking": "Hmm.", "signature": "sig-1"}


def test_thinking_blocks_are_the_assistant_turns_first_blocks() -> None:
    """As answers carry them (LiteLLM's ``thinking_blocks``), signatures kept, in order; a block
    that cannot go back (no signature, an unknown type) is left out."""
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    assistant = {
        "role": "assistant",
        "content": "Let me look.",
        "thinking_blocks": [SIGNED, {"type": "thinking", "thinking": "unsigned"}, redacted, 5],
        "tool_calls": [CALL],
    }
    tool = {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}
    out = translate(chat(USER, assistant, tool, reasoning_effort="low"))
    assert [b["type"] for b in out["messages"][1]["content"]] == [
        "thinking",
        "redacted_thinking",
        "text",
        "tool_use",
    ]
    assert out["messages"][1]["content"][:2] == [SIGNED, redacted]
    assert out["thinking"] == {"type": "enabled", "budget_tokens": 2048}


def test_a_tool_loop_without_its_thinking_block_is_sent_without_thinking() -> None:
    """Anthropic refuses thinking when the tool loop being continued did not start with its
    thinking block: that turn goes without (Anthropic allows it); a new user turn thinks."""
    bare = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    tool = {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}
    out = translate(chat(USER, bare, tool, reasoning_effort="low"))
    assert "thinking" not in out and out["max_tokens"] == 4096
    signed = {**bare, "thinking_blocks": [SIGNED]}
    second = {**bare, "tool_calls": [{**CALL, "id": "toolu_2"}]}
    tool2 = {"role": "tool", "tool_call_id": "toolu_2", "content": "19C"}
    # The loop's first assistant turn is the one that must start with thinking, not the last.
    assert "thinking" in translate(chat(USER, signed, tool, second, tool2, reasoning_effort="low"))
    assert "thinking" not in translate(
        chat(USER, bare, tool, second, tool2, reasoning_effort="low")
    )
    answered = chat(
        USER, bare, tool, {"role": "assistant", "content": "18C."}, USER, reasoning_effort="low"
    )
    assert "thinking" in translate(answered)
