"""Server-sent events, the one codec: encoding events, reading ``data:`` payloads back.

OpenAI streams are ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``; APIs with
typed events (Anthropic's Messages, OpenAI's Responses) add an ``event: <name>`` line. What
the gateway writes is always that canonical form. What it reads is any valid SSE: lines may
end with ``\\r\\n``, ``\\r`` or ``\\n`` (sse-starlette writes ``\\r\\n``), a field's colon may
be followed by one space or none (HF TGI writes ``data:[DONE]``), and an event's ``data:``
lines are joined with ``\\n``.

Reading is linear in the bytes read, whatever the reads' sizes: ``LineEnds`` makes line ends
``\\n`` with one check for ``\\r`` per read (a ``\\r\\n`` split across two reads is one line
end); ``Framing`` does that at an upstream's boundary and bounds the event not yet ended;
``EventSplitter`` keeps the unfinished event of one read for the next as a list of pieces and
looks for its end in the new bytes only (an event that never ends was re-copied on every read
before). An event past ``MAX_EVENT_BYTES`` (or the reader's limit) raises ``EventTooLong``: a
stream that never ends an event holds memory and gives the client nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

DONE = b"[DONE]"  # the payload that ends an OpenAI stream
DONE_EVENT = b"data: [DONE]\n\n"
# The largest event read: a Responses stream's ``response.completed`` carries the whole output.
MAX_EVENT_BYTES = 4 * 1024 * 1024


class EventTooLong(ValueError):
    """An SSE event grew past the reader's limit without ending (no blank line)."""


def encode(payload: Any) -> bytes:
    """One ``data:`` event of a JSON payload (compact)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def encode_named(name: str, payload: Any) -> bytes:
    """One typed event: ``event: <name>`` then its JSON ``data:``."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def payloads(data: bytes) -> Iterator[bytes]:
    """The data of every event of ``data`` (``\\n`` line ends) that has any (``DONE``
    included): its ``data:`` lines' values joined with ``\\n``, as the SSE spec reads them."""
    for event in data.split(b"\n\n"):
        payload = event_data(event)
        if payload:
            yield payload


def event_data(event: bytes) -> bytes:
    """One event's data (``b""`` for none: a comment, a keep-alive), whitespace stripped."""
    if b"\n" not in event:  # one line, as most chat chunks are
        return event[5:].strip() if event.startswith(b"data:") else b""
    values = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if len(values) == 1:
        return values[0].strip()
    # Several lines: each loses the one space after its colon (the spec), then they are joined.
    return b"\n".join(v[1:] if v.startswith(b" ") else v for v in values).strip()


class LineEnds:
    """Makes an SSE byte stream's line ends ``\\n`` (from ``\\r\\n`` or ``\\r``), across reads."""

    __slots__ = ("cr",)

    def __init__(self) -> None:
        self.cr = False  # the last read ended with "\r": a "\n" opening the next one is its pair

    def feed(self, data: bytes) -> bytes:
        if self.cr:
            self.cr = False
            if data.startswith(b"\n"):
                data = data[1:]
        if b"\r" not in data:  # every stream written with "\n": one search, no copy
            return data
        self.cr = data.endswith(b"\r")
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class Framing:
    """An upstream's SSE bytes as they are read: line ends made ``\\n``, and the event not yet
    ended bounded by ``limit`` (``EventTooLong``). The bytes pass on unsplit: one reverse search
    for a blank line per read."""

    __slots__ = ("_lines", "_newline", "_open", "limit")

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self.limit = limit
        self._lines = LineEnds()
        self._open = 0  # bytes since the last blank line: the event not yet ended
        self._newline = False  # the last read ended with "\n" (a blank line may straddle)

    def feed(self, data: bytes) -> bytes:
        lines = self._lines
        if lines.cr or b"\r" in data:  # inline: this runs on every read of every stream
            data = lines.feed(data)
        end = data.rfind(b"\n\n")
        if end >= 0:
            opened = len(data) - end - 2
        elif self._newline and data.startswith(b"\n"):
            opened = len(data) - 1
        else:
            opened = self._open + len(data)
        if opened > self.limit:
            raise EventTooLong(f"an SSE event over {self.limit} bytes")
        self._open = opened
        if data:
            self._newline = data[-1] == 10  # "\n"
        return data


class EventSplitter:
    """Cuts a byte stream into whole events (separated by a blank line), across reads."""

    __slots__ = ("_lines", "_parts", "_size", "limit")

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self.limit = limit
        self._lines = LineEnds()
        self._parts: list[bytes] = []  # the event not yet ended, as it came
        self._size = 0

    def feed(self, data: bytes) -> list[bytes]:
        data = self._lines.feed(data)
        parts = self._parts
        if parts:  # an event is open: its end is looked for in the new bytes only
            if data.startswith(b"\n") and parts[-1].endswith(b"\n"):
                first, rest = b"".join(parts)[:-1], data[1:]  # the blank line straddles reads
            else:
                end = data.find(b"\n\n")
                if end < 0:
                    self._hold(data)
                    return []
                first, rest = b"".join(parts) + data[:end], data[end + 2 :]
            parts.clear()
            self._size = 0
            *events, tail = rest.split(b"\n\n")
            events.insert(0, first)
        else:
            *events, tail = data.split(b"\n\n")
        if tail:
            self._hold(tail)
        return events

    def _hold(self, data: bytes) -> None:
        if data:
            self._parts.append(data)
            self._size += len(data)
            if self._size > self.limit:
                raise EventTooLong(f"an SSE event over {self.limit} bytes")

    @property
    def open(self) -> bool:
        """An event has begun and not ended (cheap: ``pending`` joins its pieces)."""
        return bool(self._parts)

    @property
    def pending(self) -> bytes:
        return b"".join(self._parts)
