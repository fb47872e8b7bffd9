"""The usage of a streamed answer, read from its usage chunk, which the client may not see.

Limits and cost are settled on the real token counts, so the gateway asks every streamed chat
or completion for ``stream_options.include_usage`` (``with_usage``). The answer's usage then
arrives as one chunk with ``"choices": []`` just before ``data: [DONE]``. When the client did
not ask for it, ``UsageTap(strip=True)`` takes that chunk out of the bytes the client gets, so
it sees the stream it asked for; otherwise the tap only reads. Reads are split into whole
events (an event may straddle two reads); only events naming a non-null ``usage`` are parsed,
so a long stream costs a substring search per event. With ``strip`` an unfinished event is
held until its end arrives (a client cannot use half an event anyway).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gateway.limits.cost import Usage
from gateway.protocol import upstream_json
from gateway.protocol.openai import ParsedRequest
from gateway.protocol.sse import EventSplitter, payloads

_NULL_USAGE = (b'"usage":null', b'"usage": null')
_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


def usage_in(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole (non-streamed) answer, read without parsing the rest.

    Inside a JSON string every quote is escaped, so ``"usage"`` followed by a colon is a key;
    the last one is the answer's own (it comes after the choices). Anything unexpected falls
    back to parsing the whole answer.
    """
    at = body.rfind(_USAGE_KEY)
    if at >= 0:
        rest = body[at + len(_USAGE_KEY) :].lstrip()
        if rest.startswith(b":"):
            try:
                value, _ = _DECODER.raw_decode(rest[1:].lstrip().decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                value = None
            if isinstance(value, dict):
                return value
    try:
        data = upstream_json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


def _names_usage(data: bytes) -> bool:
    """Whether ``data`` holds a usage that is not null (chunks of a stream asked for its usage
    carry ``"usage": null`` until the last)."""
    named = data.count(_USAGE_KEY)
    return named > 0 and named > sum(data.count(null) for null in _NULL_USAGE)


def asks_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def with_usage(parsed: ParsedRequest) -> ParsedRequest:
    """The request as sent upstream: a stream that reports its usage at the end."""
    opts = parsed.body.get("stream_options")
    body = {**parsed.body, "stream_options": {**(opts or {}), "include_usage": True}}
    return replace(parsed, raw=json.dumps(body).encode(), body=body)


def streamed_counts(started: Mapping[str, Any], delta: Any) -> dict[str, Any]:
    """The counts of a whole Anthropic stream: ``message_delta``'s (cumulative) over
    ``message_start``'s. The output is ``message_delta``'s alone (``message_start`` says 1 of
    any answer), so a ``message_delta`` without a readable one leaves the usage unreadable; its
    input counts, optional, keep ``message_start``'s where null."""
    counts = {key: value for key, value in started.items() if key != "output_tokens"}
    if isinstance(delta, Mapping):
        counts.update({k: v for k, v in delta.items() if v is not None or k == "output_tokens"})
    return counts


class UsageTap:
    __slots__ = ("_events", "_started", "events", "prompt", "strip", "usage")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self.events = 0  # data events seen: about the tokens streamed, if the end never comes
        self.prompt: Usage | None = None  # the input an Anthropic stream's message_start counted
        self._events = EventSplitter()
        self._started: Mapping[str, Any] | None = None  # message_start's usage

    def feed(self, data: bytes) -> bytes:
        """The bytes to send on for ``data`` (all of them unless a usage chunk is stripped)."""
        if not self._events.open and data.endswith(b"\n\n") and not _names_usage(data):
            # Whole events naming no usage (most reads of a stream): nothing to read or take
            # out, and no event is left half-read for the next one.
            self.events += data.count(b"\n\n")
            return data
        kept: list[bytes] = []
        for event in self._events.feed(data):
            self.events += 1
            names_usage = b'"usage"' in event and not any(n in event for n in _NULL_USAGE)
            if names_usage and self._read(event) and self.strip:
                continue  # the usage-only chunk the client did not ask for
            kept.append(event)
        if not self.strip:
            return data
        return b"".join(event + b"\n\n" for event in kept)

    def watch(self, data: bytes) -> None:
        """Read only (the client asked for the usage chunk too)."""
        self.feed(data)

    def flush(self) -> bytes:
        """What is held at the end of the stream (an event never terminated)."""
        rest, self._events = self._events.pending, EventSplitter()
        return rest if self.strip else b""

    def _read(self, event: bytes) -> bool:
        """Note the usage an event carries; True when it is chat's usage-only chunk.

        Chat and completions: the chunk's ``usage``. Streams relayed untranslated: the Responses
        API's ``response.completed`` (``response.usage``); Anthropic's ``message_start`` (its
        ``message.usage``: the input) then ``message_delta`` (the output: until it comes, the
        answer's usage is unknown, and a stream its client left is charged the input
        ``message_start`` counted and the events sent)."""
        for payload in payloads(event):
            try:
                obj = upstream_json.loads(payload)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if not isinstance(obj, dict):
                continue
            kind = obj.get("type")
            if kind == "message_start" or kind == "message_delta":
                self._anthropic(obj)
                return False
            raw = obj.get("usage")
            if not isinstance(raw, dict):
                inner = obj.get("response")
                raw = inner.get("usage") if isinstance(inner, dict) else None
            usage = Usage.read(raw)
            if usage is None:  # unreadable (counts past belief): the estimate is charged
                if obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                    return True  # still chat's usage-only chunk, which the client did not ask for
                continue
            self.usage = usage
            return obj.get("choices") == []
        return False

    def _anthropic(self, event: dict[str, Any]) -> None:
        if event["type"] == "message_start":
            message = event.get("message")
            started = message.get("usage") if isinstance(message, dict) else None
            self._started = started if isinstance(started, dict) else None
            if self._started is not None:  # its output is no count yet: only the input is read
                self.prompt = Usage.read(streamed_counts(self._started, {"output_tokens": 0}))
        elif self._started is not None:  # message_delta: unreadable counts leave it unknown
            self.usage = Usage.read(streamed_counts(self._started, event.get("usage")))
