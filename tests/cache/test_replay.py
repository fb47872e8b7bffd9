from __future__ import annotations

import json
from typing import Any

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cache.replay import assemble_stream, cache_headers, is_storable, replay_json, replay_sse
from cache.semantic import CacheHit

STORED: dict[str, Any] = {
    "id": "chatcmpl-upstream",
    "object": "chat.completion",
    "created": 1,
    "model": "small",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris."},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
}


def events(chunks: list[bytes]) -> list[dict[str, Any]]:
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"
    return [json.loads(c[6:]) for c in chunks[:-1]]


def test_json_replay_has_a_new_id_and_zero_usage() -> None:
    out = ChatCompletion.model_validate_json(replay_json(json.dumps(STORED).encode()))
    assert out.id != "chatcmpl-upstream" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.content == "Paris."
    assert out.usage is not None and out.usage.total_tokens == 0


def test_sse_replay_parses_as_openai_chunks_and_reassembles() -> None:
    chunks = events(replay_sse(STORED, include_usage=True))
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in parsed if p.choices)
    assert text == "Paris."
    assert parsed[-1].choices == [] and parsed[-1].usage is not None
    assert parsed[-1].usage.completion_tokens == 0
    assert len({p.id for p in parsed}) == 1
    rebuilt = assemble_stream(chunks, done=True)
    assert rebuilt is not None
    assert rebuilt["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}


def test_tool_calls_survive_replay_and_assembly() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    stored = json.loads(json.dumps(STORED))
    stored["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    stored["choices"][0]["finish_reason"] = "tool_calls"
    rebuilt = assemble_stream(events(replay_sse(stored)), done=True)
    assert rebuilt is not None
    assert rebuilt["choices"][0]["message"]["tool_calls"] == [call]


def test_text_completion_replay() -> None:
    stored = {
        "object": "text_completion",
        "model": "small",
        "choices": [{"index": 0, "text": "once upon", "finish_reason": "length"}],
    }
    assert Completion.model_validate_json(replay_json(stored)).choices[0].text == "once upon"
    chunks = events(replay_sse(stored))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "once upon"


def test_unfinished_or_failed_answers_are_not_storable() -> None:
    chunks = events(replay_sse(STORED))
    assert assemble_stream(chunks, done=False) is None
    assert assemble_stream(chunks[:-1], done=True) is None  # no finish_reason seen
    assert not is_storable({"error": {"message": "x"}})
    assert is_storable(STORED)


def test_headers() -> None:
    assert cache_headers(None) == {"x-gateway-cache": "miss"}
    hit = CacheHit("semantic", b"{}", similarity=0.93456)
    assert cache_headers(hit) == {
        "x-gateway-cache": "semantic",
        "x-gateway-cache-similarity": "0.9346",
    }
