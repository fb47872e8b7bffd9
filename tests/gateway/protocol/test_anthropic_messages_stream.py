"""Chat streams re-told as Anthropic SSE events, checked against the anthropic SDK's models and
added up as Anthropic documents (the SDK's own ``messages.stream()`` reads them in the e2e tests).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.errors import GatewayError, Unavailable, UpstreamError, UpstreamTimeout
from gateway.protocol.anthropic_messages_stream import MessagesStream
from tests.gateway.protocol.chat_stream import DONE, USAGE, chunk, events, pieces

EVENT = TypeAdapter(RawMessageStreamEvent)


def run(stream: bytes, size: int = 5, stops: tuple[str, ...] = ()) -> tuple[list[Any], Message]:
    encoder = MessagesStream("alias", stops)
    out = encoder.start()
    for piece in pieces(stream, size):
        out += encoder.feed(piece)
    told = events(out)
    for name, data in told:
        if name != "ping":
            EVENT.validate_python(data)  # raises on what the SDK needs and we left out
    return told, add_up(told)


def add_up(told: list[tuple[str, dict[str, Any]]]) -> Message:
    """The message the events describe: blocks opened, grown by their deltas, then closed."""
    assert told[0][0] == "message_start" and told[-1][0] == "message_stop"
    message = dict(told[0][1]["message"])
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    open_block: int | None = None
    for name, data in told[1:-1]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == len(blocks)
            open_block = data["index"]
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            assert data["index"] == open_block
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_block
            if data["index"] in partial:
                blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
            open_block = None
        elif name == "message_delta":
            assert open_block is None
            message.update(data["delta"])
            message["usage"] = {**message["usage"], **data["usage"]}
    message["content"] = blocks
    return Message.model_validate(message)


@pytest.mark.parametrize("size", [1, 5, 4096])
def test_a_text_stream(size: int) -> None:
    told, message = run(
        chunk({"role": "assistant", "content": ""})
        + chunk({"content": "Hel"})
        + chunk({"content": "lo"})
        + chunk(finish="stop")
        + chunk(usage=USAGE)
        + DONE,
        size,
    )
    assert [name for name, _ in told] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].type == "text" and message.content[0].text == "Hello"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 6
    assert message.usage.cache_read_input_tokens == 4
    assert message.usage.output_tokens == 5


def test_thinking_text_and_tool_use() -> None:
    told, message = run(
        chunk({"reasoning_content": "Let me think."})
        + chunk({"content": "Checking."})
        + chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            }
        )
        + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})
        + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})
        + chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "g", "arguments": "{}"},
                    }
                ]
            }
        )
        + chunk(finish="tool_calls")
        + chunk(usage=USAGE)
        + DONE
    )
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    tool = message.content[2]
    assert tool.type == "tool_use" and tool.id == "call_1" and tool.input == {"city": "Paris"}
    assert message.content[3].type == "tool_use" and message.content[3].input == {}
    assert message.stop_reason == "tool_use"
    starts = [d["index"] for n, d in told if n == "content_block_start"]
    stops = [d["index"] for n, d in told if n == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]


def test_a_stop_sequence_and_a_length_stop() -> None:
    _, message = run(
        chunk({"content": "a"}) + chunk(finish="stop", stop_reason="END") + DONE, stops=("END",)
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    _, message = run(chunk({"content": "a"}) + chunk(finish="length") + DONE)
    assert message.stop_reason == "max_tokens"


def test_an_upstream_error_becomes_an_error_event() -> None:
    encoder = MessagesStream("m")
    out = encoder.start() + encoder.feed(
        chunk({"content": "a"}) + b'data: {"error": {"message": "boom"}}\n\n'
    )
    name, data = events(out)[-1]
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    assert encoder.done and encoder.feed(DONE) == b"" and encoder.fail(UpstreamError("x")) == b""


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (UpstreamError("the connection broke"), "api_error"),
        (UpstreamTimeout("the upstream stopped sending", code="idle_timeout"), "timeout_error"),
        (Unavailable("the gateway is shutting down", code="shutting_down"), "overloaded_error"),
    ],
)
def test_the_gateways_failure_is_typed_as_its_json_answer_is(
    error: GatewayError, kind: str
) -> None:
    """The gateway's own failure mid-stream: Anthropic's type for its status, as the JSON
    answer for the same failure has it."""
    encoder = MessagesStream("m")
    told = events(encoder.start() + encoder.feed(chunk({"content": "a"})) + encoder.fail(error))
    assert told[-1] == (
        "error",
        {"type": "error", "error": {"type": kind, "message": error.message}},
    )
    assert encoder.done and encoder.failed


def test_the_deadline_ends_like_max_tokens() -> None:
    encoder = MessagesStream("m")
    out = encoder.start() + encoder.feed(chunk({"content": "partial"})) + encoder.stop()
    told = events(out)
    assert [n for n, _ in told][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert told[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert encoder.stop() == b""
