"""A chat-completions stream, re-told as the Responses API's typed stream events.

The encoder is fed the chat SSE bytes as the relay reads them and returns the Responses SSE
bytes they add up to (``event: <type>`` and ``data: <json>``, every event numbered by
``sequence_number``). The sequence:

``response.created``, ``response.in_progress`` (``start``); then, for each output item in
order, ``response.output_item.added``, its content (a message: ``response.content_part.added``,
``response.output_text.delta``... ``response.output_text.done``, ``response.content_part.done``;
a refusal the same with ``response.refusal.*``; reasoning with ``response.reasoning_text.*``
and, when the backend signed it, ``encrypted_content`` in the item's ``output_item.done``;
a tool call: ``response.function_call_arguments.delta``... ``.done``) and
``response.output_item.done``; at ``[DONE]``, ``response.completed`` (``response.incomplete``
when the model stopped at its token limit) with the whole Response and its usage. An item is
closed when the next one opens, as a Responses model streams them one after the other; but a
tool call whose arguments are not yet whole JSON when the next call opens stays open (the
upstream interleaves parallel calls' fragments) until the stream ends or text follows, so its
``response.function_call_arguments.done`` carries the whole arguments. Argument fragments sent
as JSON objects are told as their JSON text; deltas without ``index`` are placed by
``answers.ToolCallSlots``.

An upstream error event becomes an ``error`` event and ``response.failed``; so does the
gateway's own failure (``fail``), the ``error`` event with the code its JSON answer would have
(``idle_timeout``, ``total_timeout``, ``shutting_down``, ``bad_gateway``) and the failed
Response's ``error`` with a code of OpenAI's list (``server_error``) and the gateway's error
``type`` (``timeout_error``...). Responses streams end without ``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError
from gateway.protocol import upstream_json
from gateway.protocol.answers import ToolCallSlots, arguments_text
from gateway.protocol.chat_events import ChatEvents, retell
from gateway.protocol.responses import ResponsesRequest, new_id
from gateway.protocol.responses_output import (
    dicts,
    finish,
    function_call_item,
    logprobs,
    message_item,
    reasoning_item,
    skeleton,
)
from gateway.protocol.sse import encode_named
from gateway.protocol.thinking import signed_blocks


@dataclass(slots=True)
class _Item:
    kind: str  # reasoning | message | function_call
    index: int  # output_index
    id: str
    part: str = ""  # the open content part: output_text | refusal | reasoning_text
    parts: int = 0  # content parts opened so far
    text: list[str] = field(default_factory=list)  # the open part's text
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the open part's tokens
    done_parts: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    blocks: list[dict[str, Any]] = field(default_factory=list)  # a reasoning item's signed ones
    name: str = ""


class ResponsesStream:
    def __init__(self, request: ResponsesRequest, response_id: str) -> None:
        self.response = skeleton(request, response_id)
        self.done = False  # response.completed / .incomplete / .failed was sent
        self.failed = False  # the stream told of a failure (an upstream error, or fail())
        self._events = ChatEvents()
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: _Item | None = None
        self._tools: dict[int, _Item] = {}
        self._slots = ToolCallSlots()
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    # --- what the relay calls ---------------------------------------------------------------

    def start(self) -> bytes:
        out: list[bytes] = []
        self._emit(out, "response.created", response=dict(self.response))
        self._emit(out, "response.in_progress", response=dict(self.response))
        return b"".join(out)

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        retell(
            self._events,
            data,
            finished=lambda: self.done,
            complete=lambda: self._complete(out),
            fail=lambda message: self._fail(out, message),
            chunk=lambda event: self._chunk(event, out),
        )
        return b"".join(out)

    def fail(self, error: GatewayError) -> bytes:
        """The stream broke (or timed out): the client reads ``response.failed``."""
        out: list[bytes] = []
        if not self.done:
            self._fail(out, error.message, error.named_code(), error.type)
        return b"".join(out)

    def stop(self, estimate: dict[str, Any] | None = None) -> bytes:
        """The gateway's deadline: end as a model at its token limit would, with the usage
        the gateway charges (``estimate``, chat's usage object) when the upstream told none."""
        if self._usage is None:
            self._usage = estimate
        out: list[bytes] = []
        if not self.done:
            self._finish = "length"
            self._complete(out)
        return b"".join(out)

    # --- chat chunks --------------------------------------------------------------------------

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.response["model"] = chunk["model"]
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in dicts(chunk.get("choices")):
            if choice.get("index", 0) != 0:
                continue  # Responses has one output: only the first choice is told
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta, out, logprobs(choice.get("logprobs")))
            if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
                self._finish = choice["finish_reason"]

    def _delta(self, delta: dict[str, Any], out: list[bytes], tokens: list[dict[str, Any]]) -> None:
        for name in ("reasoning_content", "reasoning"):
            text = delta.get(name)
            if isinstance(text, str) and text:
                self._text(out, "reasoning", "reasoning_text", text)
                break
        blocks = signed_blocks(delta.get("thinking_blocks"))
        if blocks:  # a thinking block ended: its signature, kept with the reasoning item
            item = self._open
            if item is None or item.kind != "reasoning":
                item = self._open_item(out, "reasoning")
            item.blocks.extend(blocks)
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._text(out, "message", "output_text", content, tokens)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._text(out, "message", "refusal", refusal)
        calls = dicts(delta.get("tool_calls"))
        for position, call in enumerate(calls):
            self._tool_call(call, out, self._slots.slot(call, position, len(calls) == 1))

    def _text(
        self,
        out: list[bytes],
        kind: str,
        part: str,
        text: str,
        tokens: list[dict[str, Any]] | None = None,
    ) -> None:
        item = self._open
        if item is None or item.kind != kind:
            item = self._open_item(out, kind)
        if item.part != part:
            self._close_part(out, item)
            self._open_part(out, item, part)
        item.text.append(text)
        item.logprobs.extend(tokens or ())
        where = {"item_id": item.id, "output_index": item.index, "content_index": item.parts - 1}
        if part == "output_text":
            self._emit(
                out, "response.output_text.delta", **where, delta=text, logprobs=tokens or []
            )
        elif part == "refusal":
            self._emit(out, "response.refusal.delta", **where, delta=text)
        else:
            self._emit(out, "response.reasoning_text.delta", **where, delta=text)

    def _tool_call(self, call: dict[str, Any], out: list[bytes], index: int) -> None:
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        assert isinstance(function, dict)
        item = self._tools.get(index)
        if item is None:
            item = self._open_item(out, "function_call", call, function)
            self._tools[index] = item
        fragment = arguments_text(function.get("arguments"))
        if fragment:
            item.text.append(fragment)
            self._emit(
                out,
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=item.index,
                delta=fragment,
            )
            if self._output[item.index]:
                # A late fragment: the upstream interleaves parallel calls' arguments, and this
                # call was closed when the next one opened. Its place in the final response
                # takes the whole arguments (they were lost), as a client's snapshot does.
                arguments = "".join(item.text)
                self._output[item.index] = function_call_item(
                    item.call_id, item.name, arguments, item.id, "completed"
                )

    # --- items --------------------------------------------------------------------------------

    def _open_item(
        self,
        out: list[bytes],
        kind: str,
        call: dict[str, Any] | None = None,
        function: dict[str, Any] | None = None,
    ) -> _Item:
        for open_ in self._unfinished():
            if kind == "function_call" and open_.kind == "function_call" and not _whole(open_):
                continue  # interleaved fragments may follow: closed at the end (module comment)
            self._close_item(out, open_)
        index = len(self._output)
        self._output.append({})  # its place, filled when it is done
        if kind == "function_call":
            call_id = str((call or {}).get("id") or new_id("call"))
            name = str((function or {}).get("name") or "")
            item = _Item(kind, index, new_id("fc"), call_id=call_id, name=name)
            shown = function_call_item(call_id, name, "", item.id, "in_progress")
        elif kind == "message":
            item = _Item(kind, index, new_id("msg"))
            shown = {**message_item("", None, item.id, "in_progress"), "content": []}
        else:
            item = _Item(kind, index, new_id("rs"))
            shown = {**reasoning_item("", item.id, "in_progress"), "content": []}
        self._open = item
        self._emit(out, "response.output_item.added", output_index=index, item=shown)
        return item

    def _open_part(self, out: list[bytes], item: _Item, part: str) -> None:
        item.part = part
        item.parts += 1
        self._emit(
            out,
            "response.content_part.added",
            item_id=item.id,
            output_index=item.index,
            content_index=item.parts - 1,
            part=_part(part, ""),
        )

    def _close_part(self, out: list[bytes], item: _Item) -> None:
        if not item.part:
            return
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index, "content_index": item.parts - 1}
        if item.part == "output_text":
            self._emit(out, "response.output_text.done", **where, text=text, logprobs=item.logprobs)
        elif item.part == "refusal":
            self._emit(out, "response.refusal.done", **where, refusal=text)
        else:
            self._emit(out, "response.reasoning_text.done", **where, text=text)
        done = _part(item.part, text, item.logprobs)
        self._emit(out, "response.content_part.done", **where, part=done)
        item.done_parts.append(done)
        item.part, item.text, item.logprobs = "", [], []

    def _close_item(self, out: list[bytes], item: _Item, status: str = "completed") -> None:
        if item.kind == "function_call":
            arguments = "".join(item.text)
            self._emit(
                out,
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=item.index,
                name=item.name,
                arguments=arguments,
            )
            final = function_call_item(item.call_id, item.name, arguments, item.id, status)
        else:
            self._close_part(out, item)
            if item.kind == "message":
                final = {**message_item("", None, item.id, status), "content": item.done_parts}
            else:
                final = reasoning_item("", item.id, status, item.blocks)
                final["content"] = item.done_parts
        self._output[item.index] = final
        self._emit(out, "response.output_item.done", output_index=item.index, item=final)
        if self._open is item:
            self._open = None

    # --- the end ------------------------------------------------------------------------------

    def _complete(self, out: list[bytes]) -> None:
        status = "incomplete" if self._finish in ("length", "content_filter") else "completed"
        for item in self._unfinished():
            self._close_item(out, item, status)
        response = finish(self.response, list(self._output), self._finish, self._usage)
        self.done = True
        self._emit(out, f"response.{response['status']}", response=response)

    def _fail(
        self, out: list[bytes], message: str, code: str = "server_error", kind: str | None = None
    ) -> None:
        """``code``: the ``error`` event's; the Response's error code is one OpenAI lists (its
        clients validate it), with the gateway's error type as its ``type``."""
        self.failed = True
        for item in self._unfinished():
            self._close_item(out, item, "incomplete")
        self.done = True
        self.response["status"] = "failed"
        self.response["output"] = list(self._output)
        self.response["error"] = {"code": "server_error", "message": message, "type": kind}
        self._emit(out, "error", code=code, message=message, param=None)
        self._emit(out, "response.failed", response=self.response)

    def _unfinished(self) -> list[_Item]:
        items = [] if self._open is None else [self._open]
        items += [t for t in self._tools.values() if not self._output[t.index] and t not in items]
        return sorted(items, key=lambda item: item.index)

    def _emit(self, out: list[bytes], kind: str, **fields: Any) -> None:
        out.append(encode_named(kind, {"type": kind, "sequence_number": self._seq, **fields}))
        self._seq += 1


def _whole(item: _Item) -> bool:
    """The tool call's arguments so far are whole JSON (its last fragment came)."""
    try:
        upstream_json.loads("".join(item.text))
    except ValueError:
        return False
    return True


def _part(kind: str, text: str, tokens: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": tokens or []}
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "reasoning_text", "text": text}
