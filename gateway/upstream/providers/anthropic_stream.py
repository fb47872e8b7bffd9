"""Anthropic Messages stream events, translated into OpenAI ``chat.completion.chunk`` events.

Fed the upstream's bytes as they arrive (an event may straddle reads), it returns the OpenAI SSE
bytes each read adds up to, so the relay, the span summarizer, the cache capture and the cascade
read a stream they know. The mapping, event by event:

- ``message_start``: the first chunk, ``delta: {role: assistant, content: ""}``; id, model and
  the prompt's token counts are kept for the chunks after it;
- ``content_block_start``: a ``tool_use`` block opens a tool call (``index`` counts tool calls,
  ``id``, ``function.name``, empty ``arguments``); a text block waits for its deltas;
- ``content_block_delta``: ``text_delta`` -> ``delta.content``; ``input_json_delta`` -> the next
  fragment of that tool call's ``arguments``;
- ``content_block_stop`` of a tool call that had no argument text (a tool without parameters:
  ``input: {}`` then one empty ``partial_json``): the fragment ``{}``, so the arguments are JSON
  as in a whole answer;
- ``message_delta``: the chunk with ``finish_reason`` (mapped from ``stop_reason``); its usage
  counts are cumulative and replace the earlier ones (``gateway.protocol.usage.streamed_counts``:
  the output count is its alone);
- ``message_stop``: the usage chunk (``choices: []``) when ``stream_options.include_usage`` asked
  for it and the counts are readable (else none, as from an upstream that reports no usage:
  the answer is charged its estimate), then ``data: [DONE]``;
- ``error``: the usage chunk (when asked for: the prompt's counts from ``message_start``, the
  output's the larger of Anthropic's count and the chunks sent), so the answer is metered on
  what Anthropic counted; then ``error`` holds an ``UpstreamStreamError``, raised by the next
  ``feed`` (and by ``TranslatedStream`` before its next read), which the relay turns into its
  final SSE error event (no ``[DONE]``: the openai client raises);
- a ``thinking`` block's ``thinking_delta`` -> ``delta.reasoning_content``; at its
  ``content_block_stop``, the whole block with its signature (``signature_delta``) as
  ``delta.thinking_blocks: [{type: thinking, thinking, signature}]``, and a
  ``redacted_thinking`` block as ``[{type: redacted_thinking, data}]`` (what a client sends
  back on the assistant message: ``anthropic_response``); the call of a
  structured answer's format tool (``anthropic_options``) -> ``delta.content`` (its input is the
  answer, streamed as generated), and a ``tool_use`` stop with no other call -> ``stop``;
- ``ping``, other ``content_block_stop``s and blocks without an OpenAI counterpart: nothing.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.protocol import upstream_json
from gateway.protocol.sse import DONE_EVENT, EventSplitter, event_data
from gateway.protocol.usage import streamed_counts
from gateway.upstream.client import UpstreamStreamError
from gateway.upstream.providers.anthropic_response import (
    finish_reason,
    text_field,
    thinking_block,
    usage,
)

_THINKING = -4  # a thinking block (reasoning_content)
_FORMAT = -3  # the format tool's call: its input is the answer's content
_SKIP = -2  # a content block that is not passed on
_TEXT = -1  # a text block; tool_use blocks map to their tool call's index (0, 1, ...)


class AnthropicStream:
    __slots__ = (
        "_argued",
        "_blocks",
        "_counts",
        "_events",
        "_finished",
        "_format_tool",
        "_head",
        "_sent",
        "_signature",
        "_started",
        "_thought",
        "_tools",
        "done",
        "error",
        "include_usage",
    )

    def __init__(
        self, include_usage: bool, model: str = "", format_tool: str | None = None
    ) -> None:
        self.include_usage = include_usage
        self._format_tool = format_tool
        self.done = False  # message_stop arrived
        self.error: UpstreamStreamError | None = None  # the stream's error event
        self._sent = 0  # chunks sent (about the tokens streamed)
        self._events = EventSplitter()  # the one SSE reader: line ends, bounded events
        self._head: dict[str, Any] = {
            "id": "",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._started: dict[str, Any] = {}  # message_start's counts (the input)
        self._counts: dict[str, Any] | None = None  # the whole answer's, from message_delta
        self._blocks: dict[int, int] = {}
        self._argued: set[int] = set()  # tool calls that had argument text
        self._thought: list[str] = []  # the open thinking block's text
        self._signature: str | None = None  # and its signature
        self._tools = 0
        self._finished = False

    def feed(self, data: bytes) -> bytes:
        if self.error is not None:
            raise self.error
        out: list[bytes] = []
        for event in self._events.feed(data):
            payload = event_data(event)
            if payload:
                self._event(payload, out)
            if self.error is not None:
                break  # nothing after the error is read
        return b"".join(out)

    def _event(self, payload: bytes, out: list[bytes]) -> None:
        try:
            event = upstream_json.loads(payload)
        except ValueError as exc:
            raise UpstreamStreamError(
                "the Anthropic stream sent an event that is not JSON"
            ) from exc
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if kind == "content_block_delta":
            self._delta(event, out)
        elif kind == "message_start":
            self._start(event.get("message"), out)
        elif kind == "content_block_start":
            self._block(event, out)
        elif kind == "message_delta":
            self._message_delta(event, out)
        elif kind == "content_block_stop":
            self._block_stop(event, out)
        elif kind == "message_stop":
            self._stop(out)
        elif kind == "error":
            error = event.get("error")
            error = error if isinstance(error, dict) else {}
            if self.include_usage and self._started:  # message_start came: what it counted
                counts = self._started if self._counts is None else self._counts
                sent = {**counts, "output_tokens": max(self._sent, _output_count(counts))}
                self._usage(out, sent)
            self.error = UpstreamStreamError(
                f"Anthropic stream error {error.get('type', 'error')}: "
                f"{error.get('message', 'no message')}"
            )

    def _start(self, message: Any, out: list[bytes]) -> None:
        if isinstance(message, dict):
            if isinstance(message.get("id"), str):
                self._head["id"] = message["id"]
            if isinstance(message.get("model"), str):
                self._head["model"] = message["model"]
            if isinstance(message.get("usage"), dict):
                self._started = message["usage"]
        self._chunk(out, {"role": "assistant", "content": ""})

    def _block(self, event: dict[str, Any], out: list[bytes]) -> None:
        index, block = event.get("index"), event.get("content_block")
        if not isinstance(index, int) or not isinstance(block, dict):
            return
        kind = block.get("type")
        if kind == "text":
            self._blocks[index] = _TEXT
            if isinstance(block.get("text"), str) and block["text"]:
                self._chunk(out, {"content": block["text"]})
        elif kind == "thinking":
            self._blocks[index] = _THINKING
            self._thought, self._signature = [], None
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                self._thought.append(block["thinking"])
                self._chunk(out, {"reasoning_content": block["thinking"]})
            if isinstance(block.get("signature"), str) and block["signature"]:
                self._signature = block["signature"]
        elif kind == "redacted_thinking" and isinstance(block.get("data"), str):
            self._blocks[index] = _SKIP
            redacted = {"type": "redacted_thinking", "data": block["data"]}
            self._chunk(out, {"thinking_blocks": [redacted]})
        elif kind == "tool_use" and self._format_tool and block.get("name") == self._format_tool:
            self._blocks[index] = _FORMAT
            if block.get("input"):
                self._chunk(out, {"content": json.dumps(block["input"])})
        elif kind == "tool_use":
            tool = self._tools
            self._tools += 1
            self._blocks[index] = tool
            start = block.get("input")
            call = {
                "index": tool,
                "id": text_field(block, "id"),
                "type": "function",
                "function": {"name": text_field(block, "name"), "arguments": ""},
            }
            self._chunk(out, {"tool_calls": [call]})
            if start:  # a complete input up front (no input_json_delta will follow)
                self._arguments(out, tool, json.dumps(start))
        else:
            self._blocks[index] = _SKIP

    def _block_stop(self, event: dict[str, Any], out: list[bytes]) -> None:
        index = event.get("index")
        tool = self._blocks.get(index, _SKIP) if isinstance(index, int) else _SKIP
        if tool >= 0 and tool not in self._argued:
            self._arguments(out, tool, "{}")
        elif tool == _THINKING and self._signature is not None:
            block = thinking_block("".join(self._thought), self._signature)
            self._chunk(out, {"thinking_blocks": [block]})

    def _delta(self, event: dict[str, Any], out: list[bytes]) -> None:
        index = event.get("index")
        target = self._blocks.get(index, _SKIP) if isinstance(index, int) else _SKIP
        delta = event.get("delta")
        if target == _SKIP or not isinstance(delta, dict):
            return
        kind = delta.get("type")
        if kind == "text_delta" and target == _TEXT:
            text = delta.get("text")
            if isinstance(text, str) and text:
                self._chunk(out, {"content": text})
        elif kind == "input_json_delta" and target >= 0:
            fragment = delta.get("partial_json")
            if isinstance(fragment, str) and fragment:
                self._arguments(out, target, fragment)
        elif kind == "input_json_delta" and target == _FORMAT:
            fragment = delta.get("partial_json")
            if isinstance(fragment, str) and fragment:
                self._chunk(out, {"content": fragment})
        elif kind == "thinking_delta" and target == _THINKING:
            thought = delta.get("thinking")
            if isinstance(thought, str) and thought:
                self._thought.append(thought)
                self._chunk(out, {"reasoning_content": thought})
        elif kind == "signature_delta" and target == _THINKING:
            signature = delta.get("signature")
            if isinstance(signature, str) and signature:
                self._signature = (self._signature or "") + signature

    def _message_delta(self, event: dict[str, Any], out: list[bytes]) -> None:
        self._counts = streamed_counts(self._started, event.get("usage"))
        delta = event.get("delta")
        reason = delta.get("stop_reason") if isinstance(delta, dict) else None
        if reason == "tool_use" and not self._tools:
            reason = "end_turn"  # the only tool called was the answer's format
        if reason is not None and not self._finished:
            self._finished = True
            self._chunk(out, {}, finish_reason(reason))

    def _stop(self, out: list[bytes]) -> None:
        if not self._finished:
            self._finished = True
            self._chunk(out, {}, "stop")
        if self.include_usage and self._counts is not None:
            self._usage(out, self._counts)
        out.append(DONE_EVENT)
        self.done = True

    def _arguments(self, out: list[bytes], tool: int, fragment: str) -> None:
        self._argued.add(tool)
        self._chunk(out, {"tool_calls": [{"index": tool, "function": {"arguments": fragment}}]})

    def _usage(self, out: list[bytes], counts: dict[str, Any]) -> None:
        told = usage(counts)
        if told is None:
            return  # unreadable counts: no usage chunk, so the answer is charged its estimate
        payload = {**self._head, "choices": [], "usage": told}
        out.append(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, out: list[bytes], delta: dict[str, Any], finish: str | None = None) -> None:
        self._sent += 1
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        out.append(b"data: " + json.dumps({**self._head, "choices": [choice]}).encode() + b"\n\n")


def _output_count(counts: dict[str, Any]) -> int:
    value = counts.get("output_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
