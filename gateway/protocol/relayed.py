"""Streams relayed as they are, in APIs whose streams end with an event rather than ``[DONE]``.

OpenAI's Responses API ends with ``response.completed`` (or ``.incomplete`` / ``.failed``);
Anthropic's Messages API with ``message_stop``. The relay passes the bytes on untouched; this
watches them for the end (so a stream that stops short is still told from a finished one) and
for an ``error`` event (the upstream's own failure report), and writes the gateway's own
failures as the dialect's error event, typed as the JSON answer for the same failure is (a
Messages ``timeout_error``, a Responses code ``idle_timeout``). Event names are matched after
a newline: inside an event's JSON data a newline is always escaped, so the model's text can
never fake one. The relay made line ends ``\n``; the space after ``event:`` is optional in
SSE, so both spellings are matched.

A relayed Responses stream also names the response the upstream stores (``response_id``, read
from the first event that carries the Response object: ``response.created``), as
``answer_id`` reads it from a whole answer: the gateway records whose it is. So are the other
objects the upstream keeps for it that a later request may name by id (``owned``, read from the
final Response object; ``owned_ids``): its reasoning items (sent back by id alone, the upstream
reads them from its store) and the code-interpreter containers it made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.errors import GatewayError, UpstreamTimeout
from gateway.protocol import upstream_json
from gateway.protocol.anthropic_messages_output import error_body, error_status
from gateway.protocol.sse import EventSplitter, encode_named, event_data


def _lines(*names: bytes) -> tuple[bytes, ...]:
    """The ``event:`` lines naming ``names``, with and without the space after the colon."""
    return tuple(b"\nevent:" + space + name for name in names for space in (b" ", b""))


RESPONSES_END = _lines(b"response.completed", b"response.incomplete", b"response.failed")
MESSAGES_END = _lines(b"message_stop")
_FAILED = _lines(b"error", b"response.failed")


def responses_error(error: GatewayError) -> bytes:
    """The gateway's error in a Responses stream: its code, as its JSON answer names it."""
    payload = {"type": "error", "code": error.named_code(), "message": error.message, "param": None}
    return encode_named("error", payload)


def messages_error(error: GatewayError) -> bytes:
    """The gateway's error in a Messages stream: Anthropic's type for its status, as the JSON
    answer says it (a 504 ``timeout_error``, a 503 ``overloaded_error``)."""
    return encode_named("error", error_body(error_status(error.status), error.message))


def answer_ids(body: bytes) -> tuple[str | None, tuple[str, ...]]:
    """The id of a whole Responses answer (a Response object; None when it has none) and the
    ids of the objects it made (``owned_ids``)."""
    try:
        response = upstream_json.loads(body)
    except ValueError:
        return None, ()
    return _id_of(response), owned_ids(response)


def owned_ids(response: Any) -> tuple[str, ...]:
    """The ids a Response object's output gives its caller to name later: reasoning items and
    the containers of code-interpreter calls."""
    output = response.get("output") if isinstance(response, dict) else None
    found: list[str] = []
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        name = item.get("id") if kind == "reasoning" else None
        if kind == "code_interpreter_call":
            name = item.get("container_id")
        if isinstance(name, str) and name:
            found.append(name)
    return tuple(found)


def _id_of(response: Any) -> str | None:
    if not isinstance(response, dict):
        return None
    found = response.get("id")
    return found if isinstance(found, str) and found else None


class RelayedStream:
    __slots__ = ("_ends", "_error", "_events", "_tail", "done", "failed", "owned", "response_id")

    def __init__(
        self,
        ends: tuple[bytes, ...],
        error: Callable[[GatewayError], bytes],
        *,
        ids: bool = False,
    ) -> None:
        self._ends = ends
        self._error = error
        self._tail = b"\n"  # the stream's start counts as after a newline
        self.done = False
        self.failed = False  # an error event: the upstream's, or the gateway's (``fail``)
        self.response_id: str | None = None  # with ``ids``: the Responses stream's response
        self.owned: tuple[str, ...] = ()  # with ``ids``: what its output made (``owned_ids``)
        self._events = EventSplitter() if ids else None

    def start(self) -> bytes:
        return b""

    def feed(self, data: bytes) -> bytes:
        seen = self._tail + data
        if not self.done and any(end in seen for end in self._ends):
            self.done = True
        if any(failed in seen for failed in _FAILED):
            self.failed = True
        self._tail = seen[-32:]
        if self._events is not None:
            self._read_ids(self._events.feed(data))
        return data

    def _read_ids(self, events: list[bytes]) -> None:
        """The response's id from its first event that has it, what it made from its last."""
        for event in events:
            payload = event_data(event)
            if b'"response"' not in payload:  # a delta: no Response object in it
                continue
            last = any(end in b"\n" + event for end in self._ends)
            if self.response_id is not None and not last:
                continue
            try:
                response = upstream_json.loads(payload).get("response")
            except (ValueError, AttributeError):
                continue
            if self.response_id is None:
                self.response_id = _id_of(response)
            if last:
                self.owned = owned_ids(response)
                self._events = None
                return

    def fail(self, error: GatewayError) -> bytes:
        if self.done:
            return b""
        self.done = self.failed = True
        return self._error(error)

    def stop(self, estimate: dict[str, Any] | None = None) -> bytes:
        """The surface's deadline: a relayed stream cannot be ended as a model at its token
        limit would, so it ends as a JSON answer past the deadline does (a 504)."""
        message = "the gateway's deadline for this request passed"
        return self.fail(UpstreamTimeout(message, code="total_timeout"))
