"""Chat-completions SSE bytes, read incrementally into chunk objects (for re-telling a stream
in another API's events).

Reads are cut into whole events by the one SSE codec's ``EventSplitter``; each event's payload
is parsed once. ``[DONE]`` is reported as ``DONE``; a payload that is not a JSON object (a
comment, a keep-alive) is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from gateway.observability.log_every import LogEvery
from gateway.protocol import upstream_json
from gateway.protocol.sse import DONE as DONE_PAYLOAD
from gateway.protocol.sse import EventSplitter, payloads

DONE: Final = "[DONE]"
# What a translator's reading of an odd chunk can raise (a list where an object belongs, a
# structure too deep to write back as JSON...).
UNREADABLE: Final = (LookupError, TypeError, AttributeError, ValueError, RecursionError)
log = logging.getLogger("llm_gateway.dialects")
_unreadable = LogEvery(log)  # an upstream that sends one such chunk sends them all


class ChatEvents:
    __slots__ = ("_splitter",)

    def __init__(self) -> None:
        self._splitter = EventSplitter()

    def feed(self, data: bytes) -> list[dict[str, Any] | str]:
        out: list[dict[str, Any] | str] = []
        for event in self._splitter.feed(data):
            for payload in payloads(event):
                if payload == DONE_PAYLOAD:
                    out.append(DONE)
                    continue
                try:
                    obj = upstream_json.loads(payload)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    out.append(obj)
        return out


def retell(
    events: ChatEvents,
    data: bytes,
    *,
    finished: Callable[[], bool],
    complete: Callable[[], None],
    fail: Callable[[str], None],
    chunk: Callable[[dict[str, Any]], None],
) -> None:
    """Hand each whole event of ``data`` to the translator's handler until ``finished()``:
    ``[DONE]`` to ``complete``, an upstream error object to ``fail`` (with its message), every
    other chunk to ``chunk``. The one reading of a chat stream that other APIs re-tell. A chunk
    the handler cannot read (the translators check the shapes they use; this is the net under
    them) ends the stream with ``fail``: the client reads an error event in its own API, not a
    stream cut off mid-event."""
    for event in events.feed(data):
        if finished():
            break
        if event == DONE:
            complete()
        elif isinstance(event, dict):
            if "error" in event:
                error = event["error"] if isinstance(event["error"], dict) else {}
                fail(str(error.get("message") or "upstream error"))
            else:
                try:
                    chunk(event)
                except UNREADABLE as exc:
                    kind = type(exc).__name__
                    _unreadable.warning(
                        kind, "an upstream stream chunk could not be re-told (%s)", kind
                    )
                    fail("the upstream sent a stream chunk the gateway could not read")
