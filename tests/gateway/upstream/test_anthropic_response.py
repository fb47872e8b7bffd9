"""Anthropic answers, streams and errors translated into OpenAI's, as the gateway's stages read them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.observability.summary import StreamSummarizer
from gateway.protocol.answers import assemble
from gateway.upstream.client import UpstreamStreamError
from gateway.upstream.providers.anthropic_response import (
    chat_completion,
    finish_reason,
    openai_error,
    translate_body,
    usage,
)
from gateway.upstream.providers.anthropic_stream import AnthropicStream

MESSAGE: dict[str, Any] = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 20, "output_tokens": 9, "cache_read_input_tokens": 5},
}


def test_message_to_chat_completion() -> None:
    out = chat_completion(MESSAGE, created=123)
    assert (out["id"], out["object"], out["created"], out["model"]) == (
        "msg_01",
        "chat.completion",
        123,
        "claude-test",
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    call = choice["message"]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["type"] == "function"
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out["usage"] == {
        "prompt_tokens": 25,
        "completion_tokens": 9,
        "total_tokens": 34,
        "prompt_tokens_details": {"cached_tokens": 5},
    }


def test_text_only_and_tool_only_messages() -> None:
    text = {**MESSAGE, "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    reply = chat_completion({**text, "stop_reason": "end_turn"})["choices"][0]["message"]
    assert reply == {"role": "assistant", "content": "ab"}
    tools_only = {**MESSAGE, "content": MESSAGE["content"][1:]}
    assert chat_completion(tools_only)["choices"][0]["message"]["content"] is None
    empty = {**MESSAGE, "content": [], "stop_reason": "max_tokens"}
    assert chat_completion(empty)["choices"][0]["message"]["content"] == ""


@pytest.mark.parametrize(
    ("stop", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
        (None, "stop"),
    ],
)
def test_stop_reasons(stop: str | None, finish: str) -> None:
    assert finish_reason(stop) == finish


def test_usage_without_cache_has_no_details() -> None:
    assert usage({"input_tokens": 3, "output_tokens": 4}) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def test_errors_keep_status_and_take_openai_shape() -> None:
    raw = json.dumps(
        {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    ).encode()
    status, body = translate_body(429, raw)
    assert status == 429
    assert json.loads(body) == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_error",
        }
    }
    too_large = openai_error(413, b"<html>413 Request Entity Too Large</html>")
    assert too_large["error"]["type"] == "invalid_request_error"
    assert "413" in too_large["error"]["message"]
    named = openai_error(
        413, b'{"type":"error","error":{"type":"request_too_large","message":"big"}}'
    )
    assert named["error"]["type"] == "invalid_request_error"
    assert named["error"]["code"] == "request_too_large"
    assert openai_error(401, b"")["error"]["type"] == "authentication_error"


def test_a_200_that_is_no_message_is_an_unreadable_answer() -> None:
    with pytest.raises(ValueError, match="200 without a message"):
        translate_body(200, b'{"unexpected": true}')
    ok_status, ok = translate_body(200, json.dumps(MESSAGE).encode())
    assert ok_status == 200 and json.loads(ok)["object"] == "chat.completion"


def test_fields_of_the_wrong_type_never_reach_a_chat_client() -> None:
    """Tool ids and names are strings, whatever came; malformed counts give no usage (the
    answer is charged its estimate, not a zero)."""
    odd = {**MESSAGE, "usage": {"input_tokens": -3, "output_tokens": True,
                                "cache_read_input_tokens": "5"},
           "content": [{"type": "text", "text": 5},
                       {"type": "tool_use", "id": 5, "name": [], "input": {}}]}  # fmt: skip
    answer = chat_completion(odd)
    assert "usage" not in answer
    message = answer["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["id"] == ""
    assert message["tool_calls"][0]["function"] == {"name": "", "arguments": "{}"}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": -1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": 5}},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": 7, "name": {}, "input": {}}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": -2}},
        {"type": "message_stop"},
    ]  # fmt: skip
    chunks, done = chunks_of(
        AnthropicStream(include_usage=True).feed(b"".join(sse(e) for e in events))
    )
    assert done
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not [d for d in deltas if d.get("content")]  # the 5 is not text
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert (call["id"], call["function"]["name"]) == ("", "")
    assert not [c for c in chunks if "usage" in c]  # no usage chunk


# --- streams --------------------------------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def text_and_tool_stream() -> bytes:
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                **MESSAGE,
                "content": [],
                "stop_reason": None,
                "usage": {"input_tokens": 20, "output_tokens": 1, "cache_read_input_tokens": 5},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hé "}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "there"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ""},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "Pa'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": 'ris"}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 12},
        },
        {"type": "message_stop"},
    ]
    return b"".join(sse(e) for e in events)


def chunks_of(sse_bytes: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The chunk objects of an OpenAI SSE stream, and whether it ended with [DONE]."""
    objects, done = [], False
    for event in sse_bytes.split(b"\n\n"):
        if not event:
            continue
        assert event.startswith(b"data: ")
        payload = event[6:]
        if payload == b"[DONE]":
            done = True
            continue
        assert not done, "nothing may follow [DONE]"
        objects.append(json.loads(payload))
    return objects, done


def feed_in_pieces(stream: AnthropicStream, data: bytes, sizes: list[int]) -> bytes:
    out, at, i = [], 0, 0
    while at < len(data):
        size = sizes[i % len(sizes)]
        out.append(stream.feed(data[at : at + size]))
        at += size
        i += 1
    return b"".join(out)


def without_created(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k != "created"} for c in chunks]


def test_stream_translates_text_tool_calls_finish_and_usage() -> None:
    out = AnthropicStream(include_usage=True).feed(text_and_tool_stream())
    chunks, done = chunks_of(out)
    assert done
    assert all(c["id"] == "msg_01" and c["model"] == "claude-test" for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["content"] for d in deltas if d.get("content")] == ["Hé ", "there"]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {
        "index": 0,
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "weather", "arguments": ""},
    }
    assert [c["function"]["arguments"] for c in calls[1:]] == ['{"city": "Pa', 'ris"}']
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and finishes.count(None) == len(finishes) - 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 25,
        "completion_tokens": 12,
        "total_tokens": 37,
        "prompt_tokens_details": {"cached_tokens": 5},
    }
    # What the cache's stream capture assembles: a storable chat.completion with the tool call.
    assembled = assemble(chunks, done=done)
    assert assembled is not None
    message = assembled["choices"][0]["message"]
    assert message["content"] == "Hé there"
    assert message["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    # What the span's summarizer reads.
    summarizer = StreamSummarizer()
    summarizer.feed(out)
    summary = summarizer.summary
    assert (summary.response_id, summary.model) == ("msg_01", "claude-test")
    assert (summary.input_tokens, summary.output_tokens) == (25, 12)
    assert summary.finish_reasons == ["tool_calls"]


def test_no_usage_chunk_unless_asked() -> None:
    chunks, done = chunks_of(AnthropicStream(include_usage=False).feed(text_and_tool_stream()))
    assert done and all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


@pytest.mark.parametrize("sizes", [[1], [2], [3], [7], [13, 1, 5], [64], [200, 3]])
def test_stream_split_at_any_byte_boundary_gives_the_same_chunks(sizes: list[int]) -> None:
    data = text_and_tool_stream()
    whole, _ = chunks_of(AnthropicStream(include_usage=True).feed(data))
    pieces = feed_in_pieces(AnthropicStream(include_usage=True), data, sizes)
    split, done = chunks_of(pieces)
    assert done
    assert without_created(split) == without_created(whole)


def test_every_single_split_point() -> None:
    data = text_and_tool_stream()
    whole = without_created(chunks_of(AnthropicStream(include_usage=True).feed(data))[0])
    for cut in range(1, len(data)):
        stream = AnthropicStream(include_usage=True)
        out = stream.feed(data[:cut]) + stream.feed(data[cut:])
        assert without_created(chunks_of(out)[0]) == whole, cut


def test_crlf_line_endings_split_between_cr_and_lf() -> None:
    data = text_and_tool_stream().replace(b"\n", b"\r\n")
    whole = without_created(chunks_of(AnthropicStream(include_usage=False).feed(data))[0])
    assert len(whole) > 5
    cut = data.index(b"\r\n\r\n") + 1  # between \r and \n
    stream = AnthropicStream(include_usage=False)
    out = stream.feed(data[:cut]) + stream.feed(data[cut:])
    assert without_created(chunks_of(out)[0]) == whole


def test_error_event_mid_stream_raises_with_anthropic_message() -> None:
    stream = AnthropicStream(include_usage=False)
    head = text_and_tool_stream().split(b"event: content_block_stop")[0]
    out = stream.feed(head)
    assert b"there" in out and b"[DONE]" not in out
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert stream.feed(sse(error)[:10]) + stream.feed(sse(error)[10:]) == b""
    with pytest.raises(UpstreamStreamError) as info:
        stream.feed(b"")  # raised once what came before it was read
    assert "overloaded_error" in str(info.value) and "Overloaded" in str(info.value)
    assert stream.error is info.value


def test_an_error_mid_stream_reports_the_usage_anthropic_counted() -> None:
    """The usage chunk (when asked for) before the error: the prompt as message_start
    counted it, the output as the larger of Anthropic's count and the chunks sent."""
    stream = AnthropicStream(include_usage=True)
    head = text_and_tool_stream().split(b"event: content_block_stop")[0]
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    chunks, done = chunks_of(stream.feed(head + sse(error) + sse({"type": "ping"})))
    assert not done and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 25,
        "completion_tokens": len(chunks) - 1,  # more than the 1 message_start counted
        "total_tokens": 25 + len(chunks) - 1,
        "prompt_tokens_details": {"cached_tokens": 5},
    }
    assert stream.error is not None


def test_a_stream_cut_before_message_stop_has_no_done() -> None:
    data = text_and_tool_stream()
    cut = data.index(b"event: message_stop")
    stream = AnthropicStream(include_usage=True)
    chunks, done = chunks_of(stream.feed(data[:cut]))
    assert not done and not stream.done
    assert assemble(chunks, done=done) is None  # never stored by the cache


def test_max_tokens_stop_and_thinking_blocks_are_skipped() -> None:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {**MESSAGE, "content": [], "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hmm"},
        },
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "ok"}},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {}},
        {"type": "message_stop"},
    ]
    chunks, done = chunks_of(AnthropicStream(False).feed(b"".join(sse(e) for e in events)))
    assert done
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert "hmm" not in texts and "ok" in texts
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_streamed_tool_call_without_arguments_has_the_arguments_of_an_empty_object() -> None:
    """Anthropic streams a tool without parameters as ``input: {}`` then one empty
    ``partial_json``: the chat stream's arguments must still be JSON, as the whole answer's."""
    tool = {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {**MESSAGE, "content": [], "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": tool},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": ""},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {}},
        {"type": "message_stop"},
    ]
    chunks, done = chunks_of(AnthropicStream(False).feed(b"".join(sse(e) for e in events)))
    assembled = assemble(chunks, done=done)
    assert assembled is not None
    call = assembled["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "now", "arguments": "{}"}
    streamed, _ = chunks_of(AnthropicStream(False).feed(text_and_tool_stream()))
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for c in streamed
        if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert "".join(fragments) == '{"city": "Paris"}'  # a call with arguments gets nothing more


def test_thinking_blocks_come_back_with_their_signatures_whole_and_streamed() -> None:
    thought = {"type": "thinking", "thinking": "Let me think.", "signature": "sig=="}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    message = {**MESSAGE, "content": [thought, redacted, *MESSAGE["content"]]}
    reply = chat_completion(message)["choices"][0]["message"]
    assert reply["reasoning_content"] == "Let me think."
    assert reply["thinking_blocks"] == [thought, redacted]
    assert "thinking_blocks" not in chat_completion(MESSAGE)["choices"][0]["message"]
    opening = {"type": "thinking", "thinking": "", "signature": ""}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {**MESSAGE, "content": [], "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": opening},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "Let me "},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "think."},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "sig=="},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": redacted},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}},
        {"type": "message_stop"},
    ]
    chunks, done = chunks_of(AnthropicStream(False).feed(b"".join(sse(e) for e in events)))
    assert done
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert [b for d in deltas for b in d.get("thinking_blocks", [])] == [thought, redacted]
