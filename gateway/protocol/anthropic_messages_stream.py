"""A chat-completions stream, re-told as the Anthropic Messages API's SSE events.

Fed the chat SSE bytes as the relay reads them, it returns Anthropic's events (``event:`` and
``data:`` lines, as Anthropic's clients need both):

``message_start`` (the message with empty content; its usage is 0 until the end: a chat stream
reports usage in its last chunk; its ``model`` the upstream's, from the first chunk, as the
whole answer's is) and ``ping``, sent with the first chunk's events; a ``content_block_start`` when a
block opens (text, ``thinking`` for the backend's reasoning, ``tool_use`` for a tool call), its
``content_block_delta`` events (``text_delta``, ``thinking_delta``, ``input_json_delta`` with
the argument fragments: an object, as HF TGI sends one, as its JSON text; a delta without
``index`` placed by ``answers.ToolCallSlots``), and ``content_block_stop`` when the next block
opens or the stream ends; at ``[DONE]``, ``message_delta`` with ``stop_reason``,
``stop_sequence`` and the whole usage (input, cache reads and output tokens: Anthropic's clients
take the input counts from ``message_delta`` too), then ``message_stop``. An upstream error
becomes Anthropic's ``error`` event (``api_error``); the gateway's own failure (``fail``) too,
with the type its JSON answer would have (``timeout_error`` for a time-out,
``overloaded_error`` for a 503).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError
from gateway.protocol.answers import ToolCallSlots, arguments_text
from gateway.protocol.anthropic_messages_output import (
    error_body,
    error_status,
    new_message_id,
    stop_reason,
    usage,
)
from gateway.protocol.chat_events import ChatEvents, retell
from gateway.protocol.responses_output import dicts
from gateway.protocol.sse import encode_named


class MessagesStream:
    def __init__(
        self, model: str, stop_sequences: tuple[str, ...] = (), message_id: str | None = None
    ) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.message_id = message_id or new_message_id()
        self.done = False  # message_stop (or an error event) was sent
        self.failed = False  # an error event was sent
        self.usage: dict[str, Any] = usage(None)
        self._usage_told = False  # the upstream's usage chunk came
        self._events = ChatEvents()
        self._blocks = 0  # blocks opened so far
        self._open: str | None = None  # the open block's kind: text | thinking | tool_use
        self._tools: dict[int, int] = {}  # chat tool-call index -> block index
        self._slots = ToolCallSlots()  # the index of a delta that has none
        self._finish: str | None = None
        self._matched: Any = None
        self._started = False  # message_start was sent

    def start(self) -> bytes:
        """Nothing yet: ``message_start`` names the model that answers, which the upstream's
        first chunk tells (``_open_message``)."""
        return b""

    def _open_message(self, out: list[bytes], model: Any = None) -> None:
        if self._started:
            return
        self._started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": model if isinstance(model, str) and model else self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(None),
        }
        out.append(_event("message_start", message=message) + _event("ping"))

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        retell(
            self._events,
            data,
            finished=lambda: self.done,
            complete=lambda: self._complete(out),
            fail=lambda message: out.append(self._error(error_body(502, message))),
            chunk=lambda event: self._chunk(event, out),
        )
        return b"".join(out)

    def fail(self, error: GatewayError) -> bytes:
        if self.done:
            return b""
        return self._error(error_body(error_status(error.status), error.message))

    def stop(self, estimate: dict[str, Any] | None = None) -> bytes:
        """The gateway's deadline: end as a model at its ``max_tokens`` would, with the usage
        the gateway charges (``estimate``, chat's usage object) when the upstream told none."""
        if self.done:
            return b""
        if estimate is not None and not self._usage_told:
            self.usage = usage(estimate)
        out: list[bytes] = []
        self._finish = "length"
        self._complete(out)
        return b"".join(out)

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        self._open_message(out, chunk.get("model"))
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage(chunk["usage"])
            self._usage_told = True
        for choice in dicts(chunk.get("choices")):
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta, out)
            if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
                self._finish = choice["finish_reason"]
                self._matched = choice.get("stop_reason")

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        for name in ("reasoning_content", "reasoning"):
            text = delta.get(name)
            if isinstance(text, str) and text:
                self._text(out, "thinking", text)
                break
        for name in ("content", "refusal"):
            text = delta.get(name)
            if isinstance(text, str) and text:
                self._text(out, "text", text)
        calls = dicts(delta.get("tool_calls"))
        for position, call in enumerate(calls):
            self._tool_call(call, out, self._slots.slot(call, position, len(calls) == 1))

    def _text(self, out: list[bytes], kind: str, text: str) -> None:
        if self._open != kind:
            block: dict[str, Any] = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            self._start_block(out, kind, block)
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": text}
        )
        out.append(_event("content_block_delta", index=self._blocks - 1, delta=delta))

    def _tool_call(self, call: dict[str, Any], out: list[bytes], index: int) -> None:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        block = self._tools.get(index)
        if block is None:
            tool = {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{self.message_id[4:]}_{index}"),
                "name": str(function.get("name") or ""),
                "input": {},
            }
            self._start_block(out, "tool_use", tool)
            block = self._tools[index] = self._blocks - 1
        fragment = arguments_text(function.get("arguments"))
        if fragment:
            delta = {"type": "input_json_delta", "partial_json": fragment}
            out.append(_event("content_block_delta", index=block, delta=delta))

    def _start_block(self, out: list[bytes], kind: str, block: dict[str, Any]) -> None:
        self._close_block(out)
        self._open = kind
        out.append(_event("content_block_start", index=self._blocks, content_block=block))
        self._blocks += 1

    def _close_block(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(_event("content_block_stop", index=self._blocks - 1))
            self._open = None

    def _complete(self, out: list[bytes]) -> None:
        self._open_message(out)  # a stream with no chunk: the message is empty
        self._close_block(out)
        reason, sequence = stop_reason(self._finish or "stop", self._matched, self.stop_sequences)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(_event("message_delta", delta=delta, usage=dict(self.usage)))
        out.append(_event("message_stop"))
        self.done = True

    def _error(self, body: dict[str, Any]) -> bytes:
        """Anthropic's error event: the error object its JSON answer would be."""
        self.done = self.failed = True
        return encode_named("error", body)


def _event(kind: str, **fields: Any) -> bytes:
    return encode_named(kind, {"type": kind, **fields})
