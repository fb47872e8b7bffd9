"""The span record: what a finished span is, from the event loop to the export.

A span on the loop (``gateway.observability.spans``) ends as one ``SpanRecord``, a tuple of
plain data; the exporter (``gateway.observability.otlp``) queues it, and the encoder
(``gateway.observability.otlp_encoding``) or a caller's SDK exporter (``tracing``) reads it.
Its attributes stay in the groups the loop collected, merged only when encoded
(``merged_attributes``): the loop stores the caller's mappings as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("llm_gateway.tracing")

AttrValue = (
    str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
)
# (prefix, attributes): the prefix is prepended to each key at encoding ("gateway." for
# decisions), and None values are skipped, so the event loop stores the caller's mapping as is.
# The prefix CONSTANT marks a mapping that is shared and never changed (an attempt's replica
# attributes): its encoding is cached by identity.
# The prefix LAZY marks a group whose "mapping" is (name, argument): the function registered
# under that name (``lazy``) makes the mapping from the argument when the span is encoded (work
# such as parsing the answer's JSON for its usage is done once, in a chunk of records, after the
# answer went out, not on the request's path). A name and plain data rather
# than a closure made per request: a record is tuples, strings, numbers, bytes and mappings of
# those (two objects fewer per request for the collector to walk while the record is queued).
AttrGroup = tuple[str, Any]
CONSTANT = "="
LAZY = "()"
Event = tuple[int, str, Mapping[str, Any] | None]  # time (ns), name, attributes

# One finished span; every field is plain data, fixed at the span's end.
# (trace_id, span_id, parent_span_id or 0, name, kind, start_ns, end_ns, attribute groups,
#  events, status code (0 unset, 2 error), status message, W3C tracestate)
SpanRecord = tuple[
    int, int, int, str, int, int, int, tuple[AttrGroup, ...], tuple[Event, ...], int, str, str
]
_LAZY: dict[str, Callable[[Any], Mapping[str, Any]]] = {}


def lazy(name: str, make: Callable[[Any], Mapping[str, Any]]) -> None:
    """Register the function that a ``(LAZY, (name, argument))`` group is made with."""
    _LAZY[name] = make


KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_ERROR = 0, 2


def lazy_mapping(group: Any) -> Mapping[str, Any]:
    """A LAZY group's mapping; a function that fails gives nothing (never the export)."""
    try:
        name, argument = group
        attrs = _LAZY[name](argument)
    except Exception:
        log.exception("a span attribute function failed")
        return {}
    return attrs if isinstance(attrs, Mapping) else {}


def merged_attributes(groups: Sequence[AttrGroup]) -> dict[str, Any]:
    """A span's attributes as one mapping, as the encoder sends them (later groups win)."""
    merged: dict[str, Any] = {}
    for prefix, group in groups:
        attrs = lazy_mapping(group) if prefix == LAZY else group
        for key, value in attrs.items():
            if value is not None:
                merged[prefix + key if prefix and prefix not in (CONSTANT, LAZY) else key] = value
    return merged
