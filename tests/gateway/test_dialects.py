"""Dialect calls: what the pipeline runs, what the client reads, what a conversation keeps."""

from __future__ import annotations

import json
from typing import cast

from aiohttp import web

from gateway.conversations import StoreLimits, open_store
from gateway.dialects import MessagesCall, ResponsesCall
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.protocol.anthropic_messages import read_messages_request
from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.protocol.relayed import (
    MESSAGES_END,
    RESPONSES_END,
    RelayedStream,
    messages_error,
    responses_error,
)
from gateway.protocol.responses import read_responses_request, relayed_request
from gateway.upstream.out import StreamOut
from tests.gateway.protocol.chat_stream import DONE, USAGE, chunk, events, pieces

ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "model": "served",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Ada."}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


async def test_a_responses_conversation_is_stored_and_continued() -> None:
    store = open_store(None)
    first = ResponsesCall(read_responses_request({"model": "m", "input": "Name?"}), "t", store)
    assert first.parsed.endpoint is Endpoint.CHAT
    status, body = first.render(200, json.dumps(ANSWER).encode())
    assert status == 200 and json.loads(body)["id"] == first.response_id
    await first.ended()
    record = await store.get("t", first.response_id)
    assert record is not None
    assert record.messages == [
        {"role": "user", "content": "Name?"},
        {"role": "assistant", "content": "Ada."},
    ]
    second = ResponsesCall(
        read_responses_request(
            {"model": "m", "input": "Again?", "previous_response_id": first.response_id}
        ),
        "t",
        store,
        history=record.messages,
    )
    assert [m["content"] for m in second.parsed.body["messages"]] == ["Name?", "Ada.", "Again?"]


async def test_a_streamed_response_is_stored_when_it_ends_and_not_when_it_fails() -> None:
    store = open_store(None)
    call = ResponsesCall(
        read_responses_request({"model": "m", "input": "x", "stream": True}), "t", store
    )
    encoder = call.stream()
    encoder.start()
    for piece in pieces(chunk({"content": "hi"}) + chunk(finish="stop") + chunk(usage=USAGE), 9):
        encoder.feed(piece)
    assert not encoder.done
    encoder.feed(DONE)
    await call.ended()
    stored = await store.get("t", call.response_id)
    assert stored is not None and stored.response["status"] == "completed"
    broken = ResponsesCall(
        read_responses_request({"model": "m", "input": "x", "stream": True}), "t", store
    )
    stream = broken.stream()
    stream.feed(chunk({"content": "hi"}))
    stream.fail(UpstreamError("broke"))
    await broken.ended()
    assert await store.get("t", broken.response_id) is None


async def test_store_false_and_an_oversized_conversation_are_not_stored() -> None:
    store = open_store(None, StoreLimits(max_record_bytes=400))
    call = ResponsesCall(
        read_responses_request({"model": "m", "input": "x", "store": False}), "t", store
    )
    call.render(200, json.dumps(ANSWER).encode())
    await call.ended()
    big = ResponsesCall(read_responses_request({"model": "m", "input": "y" * 500}), "t", store)
    big.render(200, json.dumps(ANSWER).encode())
    await big.ended()  # logged, not raised: the answer was served
    assert await store.get("t", call.response_id) is None
    assert await store.get("t", big.response_id) is None


def test_a_call_translates_its_request_once() -> None:
    """``parsed`` is the translated chat request, built once (not on every read)."""
    responses = ResponsesCall(read_responses_request({"model": "m", "input": "x"}), "t", None)
    messages = MessagesCall(
        read_messages_request(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )
    )
    for call in (responses, messages):
        assert call.parsed is call.parsed and call.parsed.endpoint is Endpoint.CHAT


def test_a_messages_call_renders_answers_and_errors_in_anthropics_format() -> None:
    request = read_messages_request(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    )
    call = MessagesCall(request)
    status, body = call.render(200, json.dumps(ANSWER).encode())
    assert json.loads(body)["content"] == [{"type": "text", "text": "Ada."}]
    error = json.dumps({"error": {"message": "bad", "type": "invalid_request_error"}}).encode()
    status, body = call.render(400, error)
    assert (status, json.loads(body)["type"]) == (400, "error")
    stream = call.stream()
    told = events(stream.start() + stream.feed(chunk({"content": "a"}) + DONE))
    assert told[-1][0] == "message_stop"


def test_relayed_streams_end_on_their_dialects_last_event() -> None:
    stream = RelayedStream(MESSAGES_END, messages_error)
    text = b'event: content_block_delta\ndata: {"delta": {"text": "event: message_stop"}}\n\n'
    assert stream.feed(text) == text and not stream.done  # a model's text cannot end it
    for piece in pieces(b"event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {}\n\n", 3):
        stream.feed(piece)
    assert stream.done and not stream.failed
    responses = RelayedStream(RESPONSES_END, messages_error)
    responses.feed(b"event: response.created\ndata: {}\n\n")
    responses.feed(b"event: response.failed\ndata: {}\n\n")
    assert responses.done and responses.failed
    cut = RelayedStream(MESSAGES_END, messages_error)
    assert events(cut.fail(UpstreamError("broke")))[0][1]["error"]["message"] == "broke"
    assert cut.done and cut.failed and cut.fail(UpstreamError("again")) == b""


def test_a_relayed_stream_tells_the_gateways_failure_as_its_json_answer_would() -> None:
    idle = UpstreamTimeout("the upstream stopped sending", code="idle_timeout")
    messages = events(RelayedStream(MESSAGES_END, messages_error).fail(idle))
    assert messages == [("error", {"type": "error", "error": {"type": "timeout_error",
                                                              "message": idle.message}})]  # fmt: skip
    responses = events(RelayedStream(RESPONSES_END, responses_error).fail(idle))
    assert responses[0][1]["code"] == "idle_timeout"
    stopped = events(RelayedStream(RESPONSES_END, responses_error).stop())
    assert stopped[0][1]["code"] == "total_timeout"  # as a JSON answer past the deadline


class Sink:
    """What a ``StreamOut`` writes to, kept."""

    def __init__(self) -> None:
        self.written = b""

    async def write(self, data: bytes) -> None:
        self.written += data

    async def write_eof(self) -> None:
        return None


async def test_a_relayed_stream_the_gateway_failed_is_not_complete() -> None:
    """A passthrough stream ended by the gateway's error (a time-out, the deadline's stop) is
    a failed stream, as a translated one is: not complete, and its ``ended`` hook (a Responses
    passthrough records the upstream's response as the tenant's there) does not run."""
    store = open_store(None)
    body = {"model": "m", "input": "x", "stream": True}
    own = ParsedRequest(Endpoint.RESPONSES, json.dumps(body).encode(), body, "m", True, None)
    for end in ("error", "stop"):
        call = ResponsesCall(relayed_request("m", True, True), "t", store, passthrough=own)
        sink = Sink()
        out = StreamOut(cast(web.StreamResponse, sink), call, "up/127.0.0.1:1")
        created = {"type": "response.created", "response": {"id": f"resp_{end}"}}
        await out.write(b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n")
        if end == "error":
            await out.error(UpstreamTimeout("the upstream stopped sending", code="idle_timeout"))
        else:
            await out.stop(chat=False)
        assert b"event: error" in sink.written
        assert out.failed and not out.complete, end
        assert await store.get("t", f"resp_{end}") is None, end
