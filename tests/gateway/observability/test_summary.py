"""What the span learns from an answer: model, id, usage, finish reasons."""

from __future__ import annotations

import json

from gateway.observability.summary import StreamSummarizer, summarize_body


def test_summary_of_a_json_answer() -> None:
    body = {
        "id": "c1",
        "model": "llama",
        "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    }
    s = summarize_body(json.dumps(body).encode())
    assert (s.model, s.response_id, s.input_tokens, s.output_tokens) == ("llama", "c1", 5, 2)
    assert s.finish_reasons == ["stop"] and s.text == []
    assert summarize_body(json.dumps(body).encode(), collect_text=True).text == ["hi"]
    assert summarize_body(b"not json").model is None
    # Whitespace around the answer is fine; what is not one UTF-8 JSON value gives nothing.
    assert summarize_body(b" \n" + json.dumps(body).encode() + b"\n").model == "llama"
    nothing = [b"", b"  ", b"\xff{}", b'{"model": "m"', b"[" * 5000 + b"]" * 5000]
    assert [summarize_body(b).model for b in nothing] == [None] * len(nothing)


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_summary_of_a_stream_split_anywhere() -> None:
    events = [
        sse({"id": "c2", "model": "llama", "choices": [{"delta": {"role": "assistant"}}]}),
        sse({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}),
        sse({"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]}),
        sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}),
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream), 7):  # every way a read boundary may fall
        summarizer = StreamSummarizer(collect_text=True)
        summarizer.feed(stream[:cut])
        summarizer.feed(stream[cut:])
        s = summarizer.summary
        assert (s.model, s.response_id, s.input_tokens, s.output_tokens) == ("llama", "c2", 9, 2)
        assert s.finish_reasons == ["length"]
        assert "".join(s.text) == "ab"


def test_token_counts_past_belief_are_not_shown() -> None:
    """As the limits take them: 0..10**9 (``gateway.limits.cost.MAX_TOKENS``); beyond, or not
    a count, the span shows none (the request is charged its estimate)."""
    for bad in (10**12, 10**15, -5, True, 1.5):
        body = {"model": "m", "usage": {"prompt_tokens": bad, "completion_tokens": bad}}
        s = summarize_body(json.dumps(body).encode())
        assert (s.input_tokens, s.output_tokens) == (None, None), bad
        streamed = StreamSummarizer()
        streamed.feed(sse({**body, "choices": []}))
        assert streamed.summary.input_tokens is None, bad
    body = {"usage": {"prompt_tokens": 10**9, "completion_tokens": 0}}
    s = summarize_body(json.dumps(body).encode())
    assert (s.input_tokens, s.output_tokens) == (10**9, 0)
