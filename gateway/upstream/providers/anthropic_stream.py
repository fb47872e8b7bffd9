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
- ``message_delta``: the chunk with ``finish_reason`` (mapped from ``stop_reason``); its usage
  counts are cumulative and replace the earlier ones;
- ``message_stop``: the usage chunk (``choices: []``) when ``stream_options.include_usage`` asked
  for it, then ``data: [DONE]``;
- ``error``: raises ``UpstreamStreamError``, which the relay turns into its final SSE error event
  (no ``[DONE]``: the openai client raises);
- a ``thinking`` block's ``thinking_delta`` -> ``delta.reasoning_content``; the call of a
  structured answer's format tool (``anthropic_options``) -> ``delta.content`` (its input is the
  answer, streamed as generated), and a ``tool_use`` stop with no other call -> ``stop``;
- ``ping``, ``content_block_stop``, signatures and blocks without an OpenAI counterpart: nothing.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.protocol import upstream_json
from gateway.protocol.sse import DONE_EVENT, EventSplitter, event_data
from gateway.upstream.client import UpstreamStreamError
from gateway.upstream.providers.anthropic_response import finish_reason, text_field, usage

_THINKING = -4  # a thinking block (reasoning_content)
_FORMAT = -3  # the format tool's call: its input is the answer's content
_SKIP = -2  # a content block that is not passed on
_TEXT = -1  # a text block; tool_use blocks map to their tool call's index (0, 1, ...)


class AnthropicStream:
    __slots__ = (
        "_blocks",
        "_counts",
        "_events",
        "_finished",
        "_format_tool",
        "_head",
        "_tools",
        "done",
        "include_usage",
    )

    def __init__(
        self, include_usage: bool, model: str = "", format_tool: str | None = None
    ) -> None:
        self.include_usage = include_usage
        self._format_tool = format_tool
        self.done = False  # message_stop arrived
        self._events = EventSplitter()  # the one SSE reader: line ends, bounded events
        self._head: dict[str, Any] = {
            "id": "",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._counts: dict[str, Any] = {}
        self._blocks: dict[int, int] = {}
        self._tools = 0
        self._finished = False

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for event in self._events.feed(data):
            payload = event_data(event)
            if payload:
                self._event(payload, out)
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
        elif kind == "message_stop":
            self._stop(out)
        elif kind == "error":
            error = event.get("error")
            error = error if isinstance(error, dict) else {}
            raise UpstreamStreamError(
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
                self._counts.update(message["usage"])
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
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                self._chunk(out, {"reasoning_content": block["thinking"]})
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
                self._chunk(out, {"reasoning_content": thought})

    def _message_delta(self, event: dict[str, Any], out: list[bytes]) -> None:
        counts = event.get("usage")
        if isinstance(counts, dict):
            self._counts.update({k: v for k, v in counts.items() if v is not None})
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
        if self.include_usage:
            payload = {**self._head, "choices": [], "usage": usage(self._counts)}
            out.append(b"data: " + json.dumps(payload).encode() + b"\n\n")
        out.append(DONE_EVENT)
        self.done = True

    def _arguments(self, out: list[bytes], tool: int, fragment: str) -> None:
        self._chunk(out, {"tool_calls": [{"index": tool, "function": {"arguments": fragment}}]})

    def _chunk(self, out: list[bytes], delta: dict[str, Any], finish: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        out.append(b"data: " + json.dumps({**self._head, "choices": [choice]}).encode() + b"\n\n")
