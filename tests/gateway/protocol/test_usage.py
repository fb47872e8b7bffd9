"""The usage tap: a stream's usage chunk read, and taken out when the client did not ask."""

from __future__ import annotations

import json

import pytest

from gateway.limits.cost import Usage
from gateway.protocol.openai import Endpoint, parse_request
from gateway.protocol.usage import UsageTap, asks_usage, with_usage


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNKS = [
    event({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}),
    event({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    event(
        {
            "id": "c",
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    ),
    b"data: [DONE]\n\n",
]
STREAM = b"".join(CHUNKS)


@pytest.mark.parametrize("size", [1, 7, 64, len(STREAM)])
def test_strip_takes_out_exactly_the_usage_chunk_however_reads_split(size: int) -> None:
    tap = UsageTap(strip=True)
    out = b"".join(tap.feed(STREAM[i : i + size]) for i in range(0, len(STREAM), size))
    out += tap.flush()
    assert out == CHUNKS[0] + CHUNKS[1] + CHUNKS[3]
    assert tap.usage == Usage(input=9, cached_input=4, output=2)


def test_a_reading_tap_passes_every_byte_on() -> None:
    tap = UsageTap(strip=False)
    assert tap.feed(STREAM[:30]) + tap.feed(STREAM[30:]) == STREAM
    assert tap.usage == Usage(9, 4, 2) and tap.events == 4


def test_usage_in_a_content_chunk_is_read_but_never_stripped() -> None:
    both = event({"choices": [{"index": 0, "delta": {"content": "x"}}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})  # fmt: skip
    tap = UsageTap(strip=True)
    assert tap.feed(both) == both and tap.usage == Usage(1, 0, 1)


def test_an_unfinished_event_is_held_until_its_end_then_flushed() -> None:
    tap = UsageTap(strip=True)
    assert tap.feed(b'data: {"choices"') == b""
    assert tap.flush() == b'data: {"choices"'


def test_with_usage_asks_the_upstream_and_keeps_the_rest() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "stream": True, "stream_options": {"foo": 1}}).encode()  # fmt: skip
    parsed = parse_request(Endpoint.CHAT, raw)
    assert not asks_usage(parsed.body)
    sent = with_usage(parsed)
    assert json.loads(sent.raw)["stream_options"] == {"foo": 1, "include_usage": True}
    assert asks_usage(sent.body) and sent.model == "m" and sent.stream


def named(kind: str, obj: object) -> bytes:
    return f"event: {kind}\n".encode() + event(obj)


def test_anthropic_streams_give_input_at_the_start_and_output_at_the_end() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 11,
             "cache_read_input_tokens": 2, "output_tokens": 1}}}  # fmt: skip
    delta = {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 7}}
    tap = UsageTap(strip=False)
    assert tap.feed(named("message_start", start)) == named("message_start", start)
    # Until message_delta the output is unknown (message_start's 1 says nothing of it): no
    # usage yet, only the input it counted (what a client that leaves is charged with).
    assert tap.usage is None and tap.prompt == Usage(13, 2, 0)
    tap.feed(named("message_delta", delta))
    assert tap.usage == Usage(13, 2, 7)
    for bad in (-7, "7", 7.5, None, True, 10**13):
        tap = UsageTap(strip=False)
        tap.feed(named("message_start", start))
        tap.feed(named("message_delta", {**delta, "usage": {"output_tokens": bad}}))
        assert tap.usage is None, bad  # the estimate is charged
    bad_start = {"type": "message_start", "message": {"usage": {"input_tokens": -1}}}
    tap = UsageTap(strip=False)
    tap.feed(named("message_start", bad_start) + named("message_delta", delta))
    assert tap.usage is None and tap.prompt is None


def test_responses_streams_give_their_usage_in_response_completed() -> None:
    created = {"type": "response.created", "response": {"usage": None}}
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 9,
            "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
            "total_tokens": 12}}}  # fmt: skip
    tap = UsageTap(strip=False)
    tap.feed(named("response.created", created) + named("response.completed", done))
    assert tap.usage == Usage(9, 4, 3)
