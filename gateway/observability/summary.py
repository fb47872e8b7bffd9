"""Read what the span needs from an answer: model, id, usage, finish reasons (and its text).

An answer is in OpenAI's chat or completions shape, or, relayed untranslated (passthrough),
Anthropic's Messages (``content`` blocks, ``stop_reason``; a stream's ``message_start``,
``content_block_delta`` and ``message_delta`` events) or OpenAI's Responses (``output`` items;
a stream's ``response.*`` events carrying the response, and ``response.output_text.delta``);
usage as ``prompt_tokens``/``completion_tokens`` or ``input_tokens``/``output_tokens``.
A non-streamed answer is one JSON document. A stream is read as the relay passes it on: events
are split on blank lines (an event may straddle two reads), and only the events that can
carry something new are parsed: the first (model, id), those with a non-null
``finish_reason``, and the usage chunk, so a long stream costs a substring search per event.
Text is collected only when asked (the policy's ``record_content``). A token count is taken
only as the limits believe it (``gateway.limits.cost.believed_count``: 0..10**9).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.limits.cost import believed_count
from gateway.protocol import upstream_json
from gateway.protocol.sse import DONE, EventSplitter, payloads

_NULL_FINISH = (b'"finish_reason":null', b'"finish_reason": null')


@dataclass
class ResponseSummary:
    model: str | None = None
    response_id: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    usage: dict[str, Any] | None = None  # the answer's usage object, as the upstream sent it
    finish_reasons: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def absorb(self, obj: Any, collect_text: bool) -> None:
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if isinstance(kind, str) and kind != "message":
            self._event(kind, obj, collect_text)  # a stream's event, relayed untranslated
            return
        if self.model is None and isinstance(obj.get("model"), str):
            self.model = obj["model"]
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        self._usage(obj.get("usage"))
        if isinstance(reason := obj.get("stop_reason"), str):  # Anthropic's Message
            self.finish_reasons.append(reason)
        if collect_text:
            self._blocks(obj.get("content"))  # Anthropic's Message
            for item in _dicts(obj.get("output")):  # a Response's output items
                self._blocks(item.get("content"))
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reasons.append(reason)
            if collect_text:
                self._text(choice)

    def stopped(self, usage: dict[str, Any] | None) -> None:
        """The stream was ended by the surface's deadline, as its client was told: finish
        reason ``length``, and ``usage``, the estimate charged, unless the upstream told its own."""
        self.finish_reasons.append("length")
        if self.usage is None and usage is not None:
            self.absorb({"usage": usage}, False)

    def output_messages(self) -> str:
        """The answer's text as ``gen_ai.output.messages`` (JSON; collected with
        ``collect_text``): one assistant message, the choices' text joined."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.finish_reasons:
            message["finish_reason"] = self.finish_reasons[0]
        return json.dumps([message], ensure_ascii=False)

    def _event(self, kind: str, event: dict[str, Any], collect_text: bool) -> None:
        """One event of an Anthropic Messages or OpenAI Responses stream."""
        if kind == "message_start" or (kind.startswith("response.") and "response" in event):
            self.absorb(event.get("message") or event.get("response"), False)  # text: deltas'
        elif kind == "message_delta":
            self._usage(event.get("usage"))
            delta = event.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.finish_reasons.append(delta["stop_reason"])
        elif not collect_text:
            return
        elif kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                self.text.append(delta["text"])
        elif kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.text.append(event["delta"])

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        self.usage = usage
        # A count past belief (an upstream's bug) is not shown, as it is not charged.
        if believed_count(prompt := usage.get("prompt_tokens", usage.get("input_tokens"))):
            self.input_tokens = prompt
        output = usage.get("completion_tokens", usage.get("output_tokens"))
        if believed_count(output):
            self.output_tokens = output

    def _blocks(self, content: Any) -> None:
        """The text of content blocks (Anthropic's ``text``, a Response's ``output_text``)."""
        for block in _dicts(content):
            if block.get("type") in ("text", "output_text") and isinstance(block.get("text"), str):
                self.text.append(block["text"])

    def _text(self, choice: dict[str, Any]) -> None:
        for part in (choice.get("message"), choice.get("delta")):
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                self.text.append(part["content"])
        if isinstance(choice.get("text"), str):
            self.text.append(choice["text"])


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def summarize_body(body: bytes, collect_text: bool = False) -> ResponseSummary:
    """A whole answer's summary; nothing when it is not one JSON value in UTF-8.

    The value is read by the C scanner alone (half of ``json.loads``'s time on a short answer:
    no encoding detection, no check of what follows the value, which the relay has checked)."""
    summary = ResponseSummary()
    try:
        value, _ = _SCAN(body.decode().lstrip(), 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        return summary
    summary.absorb(value, collect_text)
    return summary


# The decoder's C scanner: (value, end) of the JSON value at an index (typeshed omits it).
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class StreamSummarizer:
    __slots__ = ("_events", "_seen_first", "collect_text", "summary")

    def __init__(self, collect_text: bool = False) -> None:
        self.collect_text = collect_text
        self.summary = ResponseSummary()
        self._events = EventSplitter()
        self._seen_first = False

    def feed(self, data: bytes) -> None:
        for event in self._events.feed(data):
            if self._wanted(event):
                self._parse(event)

    def _wanted(self, event: bytes) -> bool:
        if self.collect_text or not self._seen_first:
            return True
        if b'"usage"' in event:
            return True
        return b'"finish_reason"' in event and not any(n in event for n in _NULL_FINISH)

    def _parse(self, event: bytes) -> None:
        for payload in payloads(event):
            if payload == DONE:
                continue
            try:
                obj = upstream_json.loads(payload)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            self._seen_first = True
            self.summary.absorb(obj, self.collect_text)
