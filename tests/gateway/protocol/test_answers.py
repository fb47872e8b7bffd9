"""Finished answers <-> chunks (gateway.protocol.answers), checked with the openai SDK's types
and its own stream accumulator (the one `chat.completions.stream()` uses)."""

from __future__ import annotations

import json
from typing import Any

from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.protocol.answers import assemble, finished, render_json, render_sse
from gateway.stages.cache import StreamCapture

ANSWER: dict[str, Any] = {
    "id": "chatcmpl-upstream",
    "object": "chat.completion",
    "created": 1,
    "model": "small",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
}
CALLS = [
    {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    },
    {"id": "c2", "type": "function", "function": {"name": "time", "arguments": '{"tz": "CET"}'}},
]


def events(chunks: list[bytes]) -> list[dict[str, Any]]:
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"
    return [json.loads(c[6:]) for c in chunks[:-1]]


def with_message(**message: Any) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["message"] = {"role": "assistant", **message}
    return answer


def test_sse_parses_as_openai_chunks_and_reassembles() -> None:
    chunks = events(render_sse(ANSWER, include_usage=True))
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "Paris."
    assert parsed[-1].choices == [] and parsed[-1].usage is not None
    assert parsed[-1].usage.total_tokens == 14  # the answer's own usage
    assert all(p.usage is None for p in parsed[:-1])
    rebuilt = assemble(chunks, done=True)
    assert rebuilt is not None and rebuilt["usage"] == ANSWER["usage"]
    assert rebuilt["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert ChatCompletion.model_validate(rebuilt).choices[0].finish_reason == "stop"
    # Every choice of every chunk has the required, nullable finish_reason, as OpenAI's do.
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [
        None,
        None,
        "stop",
    ]


def test_parallel_tool_calls_keep_their_index_through_the_sdk_accumulator() -> None:
    answer = with_message(content=None, tool_calls=CALLS)
    answer["choices"][0]["finish_reason"] = "tool_calls"
    state = ChatCompletionStreamState()
    for chunk in events(render_sse(answer)):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("c1", "weather", '{"city": "Paris"}'),
        ("c2", "time", '{"tz": "CET"}'),
    ]
    rebuilt = assemble(events(render_sse(answer)), done=True)
    assert rebuilt is not None and rebuilt["choices"][0]["message"]["tool_calls"] == CALLS


def test_tool_calls_without_index_or_with_object_arguments_add_up() -> None:
    """Gemini's OpenAI endpoint sends whole calls without ``index`` (two in one chunk, or one
    per chunk); HF TGI sends ``arguments`` as a JSON object: each call stays its own, its
    arguments JSON text."""
    head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(calls: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
        delta = {"role": "assistant", "tool_calls": calls}
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    unnumbered = [{k: v for k, v in call.items() if k != "index"} for call in CALLS]
    for chunks in (
        [chunk(unnumbered), chunk([], "tool_calls")],
        [chunk(unnumbered[:1]), chunk(unnumbered[1:]), chunk([], "tool_calls")],
    ):
        answer = assemble(chunks, done=True)
        assert answer is not None
        assert answer["choices"][0]["message"]["tool_calls"] == CALLS
    as_object = {**CALLS[0], "index": 0, "function": {"name": "weather", "arguments": {"a": "é"}}}
    answer = assemble([chunk([as_object], "tool_calls")], done=True)
    assert answer is not None
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == (
        '{"a":"é"}'
    )
    # A whole answer streamed to a client that asked for a stream: the same JSON text.
    whole = with_message(content=None, tool_calls=[as_object])
    (streamed,) = [
        c for c in events(render_sse(whole)) if c["choices"][0]["delta"].get("tool_calls")
    ]
    assert streamed["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a":"é"}'


def test_logprobs_and_reasoning_survive_both_ways() -> None:
    logprobs = {"content": [{"token": "Paris", "logprob": -0.1, "bytes": None, "top_logprobs": []}]}
    answer = with_message(content="Paris.", reasoning_content="France's capital.")
    answer["choices"][0]["logprobs"] = logprobs
    chunks = events(render_sse(answer))
    assert any(c["choices"][0].get("delta", {}).get("reasoning_content") for c in chunks)
    rebuilt = assemble(chunks, done=True)
    assert rebuilt is not None
    assert rebuilt["choices"][0]["logprobs"] == logprobs
    assert rebuilt["choices"][0]["message"]["reasoning_content"] == "France's capital."


def test_vllms_stop_reason_survives_both_ways() -> None:
    """vLLM names the stop string (or token id) that ended a choice, null on every chunk
    before the last; an answer without one (OpenAI's) gets none added."""
    for matched in ("e", 128009):
        answer = with_message(content="Th")
        answer["choices"][0]["stop_reason"] = matched
        chunks = events(render_sse(answer))
        assert [c["choices"][0].get("stop_reason") for c in chunks] == [None, None, matched]
        for chunk in chunks[:-1]:
            chunk["choices"][0]["stop_reason"] = None  # as vLLM streams it
        rebuilt = assemble(chunks, done=True)
        assert rebuilt is not None and rebuilt["choices"][0]["stop_reason"] == matched
    rebuilt = assemble(events(render_sse(ANSWER)), done=True)
    assert rebuilt is not None and "stop_reason" not in rebuilt["choices"][0]


def test_text_completions_with_logprobs() -> None:
    answer: dict[str, Any] = {
        "id": "cmpl-1",
        "created": 1,
        "object": "text_completion",
        "model": "small",
        "choices": [
            {
                "index": 0,
                "text": "once upon",
                "logprobs": {"tokens": ["once", " upon"], "token_logprobs": [-0.5, -0.2]},
                "finish_reason": "length",
            }
        ],
    }
    assert Completion.model_validate_json(render_json(answer)).choices[0].text == "once upon"
    chunks = events(render_sse(answer))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "once upon"
    rebuilt = assemble(chunks, done=True)
    assert (
        rebuilt is not None
        and rebuilt["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]
    )


def test_unfinished_or_failed_answers_do_not_add_up() -> None:
    chunks = events(render_sse(ANSWER))
    assert assemble(chunks, done=False) is None
    assert assemble(chunks[:-1], done=True) is None  # no finish_reason seen
    assert assemble([*chunks, {"error": {"message": "x"}}], done=True) is None
    assert not finished({"error": {"message": "x"}})
    assert finished(ANSWER)
    assert not finished(
        with_message(content="x") | {"choices": [{"finish_reason": "content_filter"}]}
    )


def test_answers_of_another_shape_are_not_finished_and_do_not_add_up() -> None:
    """What the cache may store is an answer clients can read: odd shapes are never stored."""
    odd_messages: list[dict[str, Any]] = [
        {"content": 5},
        {"content": ["a"]},
        {"content": "x", "refusal": {}},
        {"content": "x", "tool_calls": "bad"},
        {"content": None, "tool_calls": [{"function": "x"}]},
        {"content": None, "tool_calls": [{"function": {"name": 5, "arguments": "{}"}}]},
    ]
    for message in odd_messages:
        assert not finished(with_message(**message)), message
    assert finished(with_message(content=None, tool_calls=CALLS))
    for choices in ([{"message": "x", "finish_reason": "stop"}], ["x"], 5):
        assert not finished({**ANSWER, "choices": choices})
    unhashable = with_message(content="x")
    unhashable["choices"][0]["finish_reason"] = ["stop"]
    assert not finished(unhashable)
    assert not finished(
        {"object": "text_completion", "choices": [{"text": 5, "finish_reason": "stop"}]}
    )

    good = events(render_sse(ANSWER))
    odd_chunks: list[dict[str, Any]] = [
        {"choices": 5},
        {"choices": ["x"]},
        {"choices": [{"index": "a", "delta": {"content": "x"}}]},
        {"choices": [{"index": 10**30, "delta": {"content": "x"}}]},
        {"choices": [{"index": 0, "delta": "x"}]},
        {"choices": [{"index": 0, "delta": {"content": 5}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": 5}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "a"}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": 5}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": ["stop"]}]},
    ]
    for chunk in odd_chunks:
        assert assemble([*good, chunk], done=True) is None, chunk
    assert assemble(good, done=True) is not None


def test_capture_reassembles_a_stream_split_anywhere() -> None:
    raw = b"".join(render_sse(ANSWER, include_usage=True))
    for cut in (1, 7, 50, len(raw) // 2, len(raw) - 3):
        capture = StreamCapture()
        capture.feed(raw[:cut])
        capture.feed(raw[cut:])
        stored = capture.assembled()
        assert stored is not None
        assert json.loads(stored)["choices"][0]["message"]["content"] == "Paris."
