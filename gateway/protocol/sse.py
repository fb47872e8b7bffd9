"""Server-sent events, the one codec: encoding events, reading ``data:`` payloads back.

OpenAI streams are ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``; APIs with
typed events (Anthropic's Messages, OpenAI's Responses) add an ``event: <name>`` line. Reads
of a stream split anywhere, so ``EventSplitter`` keeps the unfinished tail of one read for the
next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

DONE = b"[DONE]"  # the payload that ends an OpenAI stream
DONE_EVENT = b"data: [DONE]\n\n"


def encode(payload: Any) -> bytes:
    """One ``data:`` event of a JSON payload (compact)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def encode_named(name: str, payload: Any) -> bytes:
    """One typed event: ``event: <name>`` then its JSON ``data:``."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def payloads(data: bytes) -> Iterator[bytes]:
    """The payload of every non-empty ``data:`` line of SSE bytes (``DONE`` included)."""
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload:
                yield payload


class EventSplitter:
    """Cuts a byte stream into whole events (separated by a blank line), across reads."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        *events, self._tail = (self._tail + data).split(b"\n\n")
        return events

    @property
    def pending(self) -> bytes:
        return self._tail
