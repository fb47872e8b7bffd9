"""Responses API requests -> chat requests, and chat answers -> Response objects.

Answers are validated against the official openai SDK's own models of the Responses API, so a
field the SDK requires and we left out fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from gateway.errors import BadRequest
from gateway.protocol.responses import parse_responses_request, read_responses_request
from gateway.protocol.responses_output import from_chat_completion
from gateway.protocol.responses_params import callers_error

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def chat_of(**body: Any) -> dict[str, Any]:
    return read_responses_request({"model": "m", **body}).chat_body()


def test_a_string_input_with_instructions_and_parameters() -> None:
    chat = chat_of(
        input="Hello",
        instructions="Be brief.",
        max_output_tokens=32,
        temperature=0.2,
        top_p=0.9,
        reasoning={"effort": "low", "summary": "auto"},
        user="u-1",
        metadata={"k": "v"},
        include=["reasoning.encrypted_content"],
        truncation="auto",
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ],
        "max_completion_tokens": 32,
        "temperature": 0.2,
        "top_p": 0.9,
        "reasoning_effort": "low",
        "user": "u-1",
    }


def test_streaming_always_asks_for_the_usage_chunk() -> None:
    chat = chat_of(input="Hi", stream=True)
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}


def test_items_function_calls_and_outputs_become_chat_turns() -> None:
    chat = chat_of(
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in Paris and Rome?"},
                    {"type": "input_image", "image_url": "https://x/img.png", "detail": "low"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Rome"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert chat["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in Paris and Rome?"},
                {"type": "image_url", "image_url": {"url": "https://x/img.png", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False


def test_an_assistant_turn_with_text_then_a_call_is_one_chat_message() -> None:
    chat = chat_of(
        input=[
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_text_parts_are_joined_by_a_line_break_as_vllm_and_messages_join_them() -> None:
    """ "Summarize:" and "The report" were sent as "Summarize:The report"."""
    two = [{"type": "input_text", "text": "Summarize:"}, {"type": "input_text", "text": "Report"}]
    said = [{"type": "output_text", "text": "One."}, {"type": "output_text", "text": "Two."}]
    result = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    chat = chat_of(
        input=[
            {"role": "user", "content": two},
            {"role": "assistant", "content": said},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": result},
        ]
    )
    assert [m["content"] for m in chat["messages"]] == [
        "Summarize:\nReport",
        "One.\nTwo.",
        "a\nb",
    ]


def test_a_pdf_file_part_becomes_a_chat_file_part() -> None:
    data = "data:application/pdf;base64,JVBERi0x"
    chat = chat_of(
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_file", "file_data": data, "filename": "a.pdf"},
                    {"type": "input_text", "text": "Summarise"},
                ],
            }
        ]
    )
    assert chat["messages"][0]["content"] == [
        {"type": "file", "file": {"file_data": data, "filename": "a.pdf"}},
        {"type": "text", "text": "Summarise"},
    ]


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True},
            {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True},
            },
        ),
    ],
)
def test_text_format_becomes_response_format(fmt: dict[str, Any], expected: Any) -> None:
    chat = chat_of(input="x", text={"format": fmt, "verbosity": "low"})
    assert chat.get("response_format") == expected


def test_history_goes_between_instructions_and_the_new_input() -> None:
    request = read_responses_request({"model": "m", "input": "And now?", "instructions": "I"})
    history = [{"role": "user", "content": "Before"}, {"role": "assistant", "content": "Ok"}]
    assert [m["content"] for m in request.chat_body(history)["messages"]] == [
        "I",
        "Before",
        "Ok",
        "And now?",
    ]


def test_input_items_are_normalised_with_ids() -> None:
    request = read_responses_request({"model": "m", "input": "Hi"})
    (item,) = request.items
    assert item["id"].startswith("msg_")
    assert item["type"] == "message"
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]
    assert request.store is True


TWICE = {"role": "user", "content": "a", "id": "msg_1"}
TEXT = {"type": "input_text", "text": "shot:"}


def tool_output(parts: list[Any]) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": "c1", "output": parts}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER, {"type": "file_search"}]}, "tools[1].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),  # once a 500
        ({"input": [{"role": {}, "content": "x"}]}, "input[0].role"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({}, "input"),
        ({"input": [TWICE, TWICE]}, "input[1].id"),  # input_items paged a repeated id forever
        # A chat tool message holds text only: images and files were dropped without a word,
        # and parts of any shape accepted.
        (
            {"input": [tool_output([TEXT, {"type": "input_image", "image_url": "x"}])]},
            "input[0].output[1]",
        ),
        (
            {"input": [tool_output([{"type": "input_file", "file_data": "x"}])]},
            "input[0].output[0]",
        ),
        ({"input": [tool_output(["str"])]}, "input[0].output[0]"),
        ({"input": [tool_output([{"type": "bogus"}])]}, "input[0].output[0].type"),
        ({"input": [tool_output([{"type": "input_text"}])]}, "input[0].output[0].text"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        read_responses_request({"model": "m", **body})
    assert info.value.param == param


def test_a_body_that_is_not_json_is_a_400() -> None:
    with pytest.raises(BadRequest):
        parse_responses_request(b"{nope")
    with pytest.raises(BadRequest) as info:
        parse_responses_request(json.dumps({"input": "x"}).encode())
    assert info.value.param == "model"


# --- answers ---------------------------------------------------------------------------------


def answer(message: dict[str, Any], finish: str = "stop", **usage: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "served-model",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19, **usage},
    }


def respond(chat_answer: dict[str, Any], **body: Any) -> Response:
    request = read_responses_request({"model": "alias", "input": "x", **body})
    data = from_chat_completion(chat_answer, request, "resp_1")
    return Response.model_validate(data)  # the SDK's own model of a Response


def test_a_text_answer_with_cached_and_reasoning_tokens() -> None:
    response = respond(
        answer(
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
            prompt_tokens_details={"cached_tokens": 8},
            completion_tokens_details={"reasoning_tokens": 3},
        ),
        instructions="Be kind.",
        temperature=0.5,
        metadata={"a": "b"},
    )
    assert response.id == "resp_1"
    assert response.status == "completed"
    assert response.output_text == "Hello!"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "Greet."
    assert response.usage is not None
    assert response.usage.input_tokens == 12
    assert response.usage.input_tokens_details.cached_tokens == 8
    assert response.usage.output_tokens == 7
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    assert response.usage.total_tokens == 19
    assert response.instructions == "Be kind."
    assert response.temperature == 0.5
    assert response.metadata == {"a": "b"}
    assert response.created_at == 1700000000


def test_tool_calls_become_function_call_items() -> None:
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    response = respond(
        answer({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"),
        tools=[WEATHER],
    )
    assert [(i.type, getattr(i, "call_id", None)) for i in response.output] == [
        ("function_call", "call_a"),
        ("function_call", "call_b"),
    ]
    first = response.output[0]
    assert first.type == "function_call"
    assert (first.name, first.arguments) == ("f", '{"x":1}')
    assert response.tools[0].type == "function"


def test_a_length_stop_is_an_incomplete_response() -> None:
    response = respond(answer({"role": "assistant", "content": "Hel"}, "length"))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hel"


def test_no_usage_from_the_backend_is_zero_not_missing() -> None:
    chat_answer = answer({"role": "assistant", "content": "x"})
    del chat_answer["usage"]
    response = respond(chat_answer)
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.total_tokens) == (0, 0)
    assert response.usage.input_tokens_details.cached_tokens == 0


def test_top_logprobs_are_asked_for_and_returned() -> None:
    chat = chat_of(input="x", top_logprobs=2)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    token = {
        "token": "Hi",
        "logprob": -0.1,
        "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
    }
    chat_answer = answer({"role": "assistant", "content": "Hi"})
    chat_answer["choices"][0]["logprobs"] = {"content": [token]}
    response = respond(chat_answer, top_logprobs=2)
    item: Any = response.output[0]
    part = item.content[0]
    assert part.type == "output_text" and part.logprobs is not None
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [("Hi", -0.1)]
    assert part.logprobs[0].top_logprobs[0].token == "Hi"


def test_only_an_error_about_the_output_limit_is_told_in_the_callers_parameter() -> None:
    about = {"error": {"message": "'max_completion_tokens' must be at least 1", "param": None}}
    told = json.loads(callers_error(json.dumps(about).encode()))
    assert told["error"] == {"message": "'max_output_tokens' must be at least 1",
                             "param": "max_output_tokens"}  # fmt: skip
    for other in (
        b'{"error": {"message": "max_tokens is fine; temperature is not", "param": "temperature"}}',
        b'{"error": "flat"}',
        b"<html>Bad gateway</html>",
    ):
        assert callers_error(other) == other
