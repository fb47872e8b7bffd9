"""Chat streams re-told as Responses stream events, checked against the openai SDK's models."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import GatewayError, Unavailable, UpstreamError, UpstreamTimeout
from gateway.protocol.responses import read_responses_request
from gateway.protocol.responses_stream import ResponsesStream
from tests.gateway.protocol.chat_stream import DONE, USAGE, chunk, events, pieces

EVENT = TypeAdapter(ResponseStreamEvent)


def run(stream_bytes: bytes, size: int = 7, **body: Any) -> tuple[ResponsesStream, list[Any]]:
    request = read_responses_request({"model": "alias", "input": "x", "stream": True, **body})
    encoder = ResponsesStream(request, "resp_s")
    out = encoder.start()
    for piece in pieces(stream_bytes, size):
        out += encoder.feed(piece)
    told = events(out)
    for _, data in told:
        EVENT.validate_python(data)  # raises on any field the SDK needs and we left out
    assert [d["sequence_number"] for _, d in told] == list(range(len(told)))
    return encoder, told


TEXT = (
    chunk({"role": "assistant", "content": ""})
    + chunk({"content": "Hel"})
    + chunk({"content": "lo"})
    + chunk(finish="stop")
    + chunk(usage=USAGE)
    + DONE
)


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_text_stream(size: int) -> None:
    encoder, told = run(TEXT, size)
    assert [name for name, _ in told] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["delta"] for n, d in told if n == "response.output_text.delta"] == ["Hel", "lo"]
    item_ids = {d["item_id"] for n, d in told if "item_id" in d}
    assert len(item_ids) == 1
    final = Response.model_validate(told[-1][1]["response"])
    assert final.id == "resp_s" and final.status == "completed"
    assert final.output_text == "Hello"
    assert final.output[0].id in item_ids
    assert final.model == "served-model"
    assert final.usage is not None
    assert final.usage.input_tokens_details.cached_tokens == 4
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    assert encoder.done and encoder.response["output"] == told[-1][1]["response"]["output"]
    created = Response.model_validate(told[0][1]["response"])
    assert created.status == "in_progress" and created.output == []


def test_reasoning_then_text_then_two_tool_calls() -> None:
    stream = (
        chunk({"role": "assistant", "content": ""})
        + chunk({"reasoning_content": "Think"})
        + chunk({"content": "Let me look."})
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
        + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]})
        + chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})
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
    _, told = run(stream)
    names = [name for name, _ in told]
    assert names.count("response.output_item.added") == 4
    assert names.count("response.output_item.done") == 4
    assert [d["delta"] for n, d in told if n == "response.function_call_arguments.delta"] == [
        '{"a"',
        ":1}",
        "{}",
    ]
    done = [d for n, d in told if n == "response.function_call_arguments.done"]
    assert [(d["name"], d["arguments"]) for d in done] == [("f", '{"a":1}'), ("g", "{}")]
    final = Response.model_validate(told[-1][1]["response"])
    assert [i.type for i in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert [getattr(i, "call_id", None) for i in final.output[2:]] == ["call_1", "call_2"]
    # each item is done before the next is added, as a Responses model streams them
    opened = [n for n in names if n.startswith("response.output_item.")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * 4


def test_a_length_stop_ends_with_response_incomplete() -> None:
    _, told = run(chunk({"content": "abc"}) + chunk(finish="length") + DONE)
    name, data = told[-1]
    assert name == "response.incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["response"]["output"][0]["status"] == "incomplete"


def test_an_upstream_error_event_fails_the_response() -> None:
    error = b'data: {"error": {"message": "boom", "type": "upstream_error"}}\n\n'
    encoder, told = run(chunk({"content": "ab"}) + error)
    assert [n for n, _ in told][-2:] == ["error", "response.failed"]
    assert told[-2][1]["message"] == "boom"
    assert told[-1][1]["response"]["status"] == "failed"
    assert told[-1][1]["response"]["error"]["message"] == "boom"
    assert encoder.done
    assert encoder.feed(DONE) == b""  # nothing after the end


def test_the_gateways_deadline_and_a_broken_stream() -> None:
    request = read_responses_request({"model": "m", "input": "x", "stream": True})
    stopped = ResponsesStream(request, "resp_d")
    out = stopped.start() + stopped.feed(chunk({"content": "partial"}))
    told = events(out + stopped.stop())
    assert told[-1][0] == "response.incomplete"
    assert Response.model_validate(told[-1][1]["response"]).output_text == "partial"
    assert stopped.stop() == b""
    broken = ResponsesStream(request, "resp_b")
    told = events(broken.start() + broken.fail(UpstreamError("the upstream connection broke")))
    assert [n for n, _ in told][-2:] == ["error", "response.failed"]
    assert told[-2][1]["code"] == "bad_gateway"
    assert broken.fail(UpstreamError("again")) == b""


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (UpstreamTimeout("the upstream stopped sending", code="idle_timeout"), "idle_timeout"),
        (UpstreamTimeout("past the backend's total_s", code="total_timeout"), "total_timeout"),
        (Unavailable("the gateway is shutting down", code="shutting_down"), "shutting_down"),
    ],
)
def test_the_gateways_failure_keeps_its_code_and_type(error: GatewayError, code: str) -> None:
    """The ``error`` event names the code the JSON answer would; the failed Response's error
    has a code of OpenAI's list (its SDK validates it) and the gateway's error type."""
    request = read_responses_request({"model": "m", "input": "x", "stream": True})
    encoder = ResponsesStream(request, "resp_f")
    told = events(encoder.start() + encoder.feed(chunk({"content": "a"})) + encoder.fail(error))
    (_, event), (_, failed) = told[-2:]
    assert (event["code"], event["message"]) == (code, error.message)
    response = Response.model_validate(failed["response"])
    assert response.error is not None
    assert (response.error.code, response.error.type) == ("server_error", error.type)


def test_other_choices_are_not_told() -> None:
    second = chunk({"content": "other"}).replace(b'"index": 0', b'"index": 1')
    _, told = run(chunk({"content": "first"}) + second + chunk(finish="stop") + DONE)
    assert [d["delta"] for n, d in told if n == "response.output_text.delta"] == ["first"]


def test_streamed_logprobs_come_with_their_deltas() -> None:
    token = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    stream = chunk({"content": "a"}, logprobs={"content": [token]}) + chunk(finish="stop") + DONE
    _, told = run(stream, top_logprobs=1)
    (delta,) = [d for n, d in told if n == "response.output_text.delta"]
    assert delta["logprobs"] == [token]
    (done,) = [d for n, d in told if n == "response.output_text.done"]
    assert done["logprobs"] == [token]
    final = Response.model_validate(told[-1][1]["response"])
    item: Any = final.output[0]
    assert item.content[0].logprobs[0].logprob == -0.5


def test_interleaved_parallel_calls_keep_every_argument() -> None:
    """An upstream that sends both calls' heads, then their arguments by turns: the first call
    was closed when the second opened, and its arguments were lost from the final response
    (then, still, from its ``.done`` event). A call whose arguments are not whole JSON stays
    open until the stream ends."""

    def head(index: int, name: str) -> dict[str, Any]:
        call = {"index": index, "id": f"c{index}", "type": "function"}
        return {**call, "function": {"name": name, "arguments": ""}}

    def part(index: int, text: str) -> bytes:
        return chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    stream = (
        chunk({"role": "assistant", "tool_calls": [head(0, "f"), head(1, "g")]})
        + part(0, '{"city"')
        + part(1, '{"city"')
        + part(0, ': "Paris"}')
        + part(1, ': "Rome"}')
        + chunk(finish="tool_calls")
        + DONE
    )
    _, told = run(stream)
    final = Response.model_validate(told[-1][1]["response"])
    calls = [(i.call_id, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [("c0", '{"city": "Paris"}'), ("c1", '{"city": "Rome"}')]
    done = [d["arguments"] for n, d in told if n == "response.function_call_arguments.done"]
    assert done == ['{"city": "Paris"}', '{"city": "Rome"}']
    items = [(n, d["output_index"]) for n, d in told if n.startswith("response.output_item.")]
    assert items == [
        ("response.output_item.added", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 0),
        ("response.output_item.done", 1),
    ]
