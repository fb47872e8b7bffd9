"""Chat-completions SSE streams for the dialect tests, and a reader of the events they become."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    **choice: Any,
) -> bytes:
    """One ``data:`` event of a chat stream (a usage-only chunk when ``delta`` is None)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "served-model",
        "choices": [],
    }
    if delta is not None or finish is not None:
        body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}]
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 5,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 4},
    "completion_tokens_details": {"reasoning_tokens": 2},
}


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    """``data`` cut every ``size`` bytes, so events straddle reads."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def events(sse: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; every event must have both lines."""
    out = []
    for block in sse.split(b"\n\n"):
        if not block:
            continue
        lines = block.split(b"\n")
        assert len(lines) == 2 and lines[0].startswith(b"event: "), block
        assert lines[1].startswith(b"data: "), block
        name = lines[0][7:].decode()
        data = json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out
