"""OTLP protobuf encoding of span records, written out by hand against the proto field numbers.

A span is a handful of length-delimited fields. Most of its attributes repeat from one request
to the next (operation, model, tenant, surface, backend, replica, server address), so a group
of them that repeats is kept encoded whole and costs one lookup; the rest (ids, token counts,
timings) are written straight from their values (``Encoder``). The output is the wire format of
``opentelemetry-proto``'s ``ExportTraceServiceRequest`` (tests decode it with its generated
classes); the exporter (``gateway.observability.otlp``) calls the encoder on the event loop, a
chunk of records at a time.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.observability.span_records import (
    CONSTANT,
    LAZY,
    AttrGroup,
    SpanRecord,
    lazy_mapping,
    merged_attributes,
)

_CACHE_MAX = 8192
# What a cache keeps is bounded in bytes too, not only in entries: a string longer than this
# (characters), or a group or array whose encoding is longer (bytes), is encoded each time and
# never kept, so one odd span (a caller's 4 MB model name) cannot pin memory in 8192 entries.
_KEEP_MAX = 512
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_KIND_TIMES = struct.Struct("<BBBQBQ")  # kind (a one-byte varint), start and end times
_FIXED64, _DOUBLE = struct.Struct("<Q"), struct.Struct("<d")
# The field tags of a KeyValue: Resource.attributes (1), Span.attributes (9), Event.attributes (3)
_TAG_RESOURCE, _TAG_SPAN, _TAG_EVENT = b"\x0a", b"\x4a", b"\x1a"
_ONE_BYTE = [bytes((n,)) for n in range(0x80)]
# KeyValue.value's field and AnyValue.string_value's field for a string of n < 0x7E bytes
_STRING_HEADS = [bytes((0x12, n + 2, 0x0A, n)) for n in range(0x7E)]
_SMALL_INTS = [bytes((0x12, 2, 0x18, n)) for n in range(0x80)]  # value field, int_value n
_Group = tuple[bytes, frozenset[str]]  # a group's encoded attributes and their keys
_NO_NAMES: frozenset[str] = frozenset()


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _big_int_text(value: int) -> str:
    """An integer beyond int64 (a caller's ``seed`` of 10**30) as text; one past the digits
    Python prints (4,300) by its sign and size."""
    try:
        return str(value)
    except ValueError:
        return f"{'-' if value < 0 else ''}<integer of {value.bit_length()} bits>"


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _kept_field(cache: dict[str, bytes], number: int, text: str) -> bytes:
    """``text`` as the string field ``number``, kept in ``cache`` (cleared when full)."""
    encoded = cache.get(text)
    if encoded is None:
        if len(text) > _KEEP_MAX:
            return _field(number, text.encode())
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        encoded = cache[text] = _field(number, text.encode())
    return encoded


def _any_value(value: Any) -> bytes:
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            return b"\x18" + _varint(value)
        return _field(1, _big_int_text(value).encode())  # int_value is an int64: as a string
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, str):
        return _field(1, value.encode())
    if isinstance(value, (list, tuple)):
        return _field(5, b"".join(_field(1, _any_value(v)) for v in value))
    return _field(1, str(value).encode())


class Encoder:
    """Span records -> ``ExportTraceServiceRequest`` bytes (one resource, one scope).

    An attribute is written straight from its value (its key's bytes are kept per key); a
    group that repeats from one request to the next (the decisions: tenant, surface, backend,
    replica...) is kept whole, per (prefix, keys, values), so it costs one lookup; a
    ``CONSTANT`` group is kept by identity; a ``LAZY`` group and events (ids, token counts,
    timings: new each time) are written attribute by attribute. Caches are bounded (cleared
    when full at 8192 entries; an entry over ``_KEEP_MAX`` is never kept). A group's entry
    carries its keys: a span whose groups share no key (the usual case) is the concatenation of
    its groups' bytes; one where a key is set twice is merged first (later groups win, a key is
    sent once).
    """

    def __init__(self, resource: Mapping[str, Any], scope: str = "llm_gateway") -> None:
        self._heads: dict[str, bytes] = {}
        self._groups: dict[tuple[Any, ...], _Group] = {}
        self._constants: dict[tuple[bytes, int], tuple[Mapping[str, Any], _Group]] = {}
        self._names: dict[str, bytes] = {}
        self._event_names: dict[str, bytes] = {}
        self._arrays: dict[tuple[Any, ...], bytes] = {}
        self._resource = _field(1, self._encode(_TAG_RESOURCE, "", resource)[0])
        self._scope = _field(1, _field(1, scope.encode()))

    def _array(self, items: tuple[Any, ...]) -> bytes:
        """``KeyValue.value``'s field holding an ``ArrayValue``, kept per distinct array."""
        try:
            encoded = self._arrays.get(items)
        except TypeError:  # an unhashable item: not kept
            any_value = _any_value(items)
            return b"\x12" + _varint(len(any_value)) + any_value
        if encoded is None:
            any_value = _any_value(items)
            encoded = b"\x12" + _varint(len(any_value)) + any_value
            if len(encoded) > _KEEP_MAX:
                return encoded
            if len(self._arrays) >= _CACHE_MAX:
                self._arrays.clear()
            self._arrays[items] = encoded
        return encoded

    def _attribute(self, tag: bytes, key: str, value: Any) -> bytes:
        """One ``KeyValue`` as the field ``tag`` (attributes of a span, an event, a resource)."""
        head = self._heads.get(key) or _kept_field(self._heads, 1, key)  # KeyValue.key
        body: bytes
        kind = type(value)
        if kind is str:
            raw = value.encode()
            n = len(raw)
            if n < 0x7E:  # both lengths fit a one-byte varint
                body = head + _STRING_HEADS[n] + raw
            else:
                any_value = _field(1, raw)
                body = head + b"\x12" + _varint(len(any_value)) + any_value
        elif kind is int and 0 <= value < 0x80:
            body = head + _SMALL_INTS[value]
        elif kind is float:
            body = head + b"\x12\x09\x21" + _DOUBLE.pack(value)
        elif kind is bool:
            body = head + (b"\x12\x02\x10\x01" if value else b"\x12\x02\x10\x00")
        elif kind is list or kind is tuple:  # finish reasons: a few distinct lists, kept
            body = head + self._array(tuple(value))
        else:
            any_value = _any_value(value)
            body = head + b"\x12" + _varint(len(any_value)) + any_value
        n = len(body)
        return tag + (_ONE_BYTE[n] if n < 0x80 else _varint(n)) + body

    def _encode(self, tag: bytes, prefix: str, attrs: Mapping[str, Any]) -> _Group:
        parts: list[bytes] = []
        keys: list[str] = []
        attribute = self._attribute
        for key, value in attrs.items():
            if value is not None:
                if prefix:
                    key = prefix + key
                keys.append(key)
                parts.append(attribute(tag, key, value))
        return b"".join(parts), frozenset(keys)

    def _group(self, tag: bytes, prefix: str, attrs: Mapping[str, Any]) -> _Group:
        values = tuple(attrs.values())
        try:  # the values' types too: 1, 1.0 and True are equal keys, not equal encodings
            key = (tag, prefix, tuple(attrs), values, tuple(map(type, values)))
            group = self._groups.get(key)
        except TypeError:  # a list value: written attribute by attribute, not kept whole
            return self._encode(tag, prefix, attrs)
        if group is None:
            group = self._encode(tag, prefix, attrs)
            if len(group[0]) > _KEEP_MAX:
                return group
            if len(self._groups) >= _CACHE_MAX:
                self._groups.clear()
            self._groups[key] = group
        return group

    def _constant(self, tag: bytes, attrs: Mapping[str, Any]) -> _Group:
        seen = self._constants.get((tag, id(attrs)))
        if seen is not None and seen[0] is attrs:
            return seen[1]
        group = self._encode(tag, "", attrs)
        if len(self._constants) >= _CACHE_MAX:
            self._constants.clear()
        self._constants[(tag, id(attrs))] = (attrs, group)  # the ref keeps the id unique
        return group

    def _attributes(self, tag: bytes, groups: Sequence[AttrGroup]) -> bytes:
        parts: list[bytes] = []
        names: list[frozenset[str]] = []
        evaluated: list[Mapping[str, Any]] = []  # LAZY functions are called once: their mappings
        for prefix, attrs in groups:
            if prefix == CONSTANT:
                encoded, keys = self._constant(tag, attrs)
            elif prefix == LAZY:
                attrs = lazy_mapping(attrs)
                evaluated.append(attrs)
                encoded, keys = self._encode(tag, "", attrs)
            else:
                encoded, keys = self._group(tag, prefix, attrs)
            parts.append(encoded)
            names.append(keys)
        if len(names) > 1 and sum(map(len, names)) != len(_NO_NAMES.union(*names)):
            # A key set twice (or one mapping given twice): merged, later groups win.
            done = iter(evaluated)
            resolved = [("", next(done)) if p == LAZY else (p, a) for p, a in groups]
            merged = merged_attributes(resolved)
            return b"".join(self._attribute(tag, k, v) for k, v in merged.items())
        return b"".join(parts)

    def span(self, record: SpanRecord) -> bytes:
        """One ``Span``. A string that is not valid Unicode (a lone surrogate, which an
        upstream's JSON answer can carry in its model or id; requests with one are refused
        before any span) is sent with U+FFFD in its place, and only its span pays for it."""
        try:
            return self._span(record)
        except UnicodeEncodeError:
            return self._span(_replaced(record))

    def _span(self, record: SpanRecord) -> bytes:
        (trace_id, span_id, parent_id, name, kind, start_ns, end_ns, groups, events,
         status, message, trace_state) = record  # fmt: skip
        parts = [
            b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")
        ]
        if trace_state:
            parts.append(_field(3, trace_state.encode()))
        if parent_id:
            parts.append(b"\x22\x08" + parent_id.to_bytes(8, "big"))
        parts.append(self._names.get(name) or _kept_field(self._names, 5, name))
        parts.append(_KIND_TIMES.pack(0x30, kind, 0x39, start_ns, 0x41, end_ns))
        parts.append(self._attributes(_TAG_SPAN, groups))
        for at_ns, event_name, attrs in events:
            body = b"\x09" + _FIXED64.pack(at_ns) + _kept_field(self._event_names, 2, event_name)
            if attrs:
                body += self._encode(_TAG_EVENT, "", attrs)[0]
            parts.append(_field(11, body))
        if status:
            status_body = (
                (_field(2, message.encode()) if message else b"") + b"\x18" + _varint(status)
            )
            parts.append(_field(15, status_body))
        return _field(2, b"".join(parts))

    def request(self, encoded_spans: Sequence[bytes]) -> bytes:
        """One ``ExportTraceServiceRequest``: the fields' lengths first, then one join (a batch
        is ~300 KB: each concatenation would copy it, and fault in fresh pages, once more)."""
        spans_len = sum(map(len, encoded_spans))
        scope_spans_len = len(self._scope) + spans_len
        scope_head = b"\x12" + _varint(scope_spans_len)  # ResourceSpans.scope_spans (2)
        resource_spans_len = len(self._resource) + len(scope_head) + scope_spans_len
        head = b"\x0a" + _varint(resource_spans_len)  # resource_spans (1)
        return b"".join((head, self._resource, scope_head, self._scope, *encoded_spans))


def _replaced(record: SpanRecord) -> SpanRecord:
    """``record`` with every string made encodable (LAZY groups evaluated first)."""

    def text(value: Any) -> Any:
        if isinstance(value, str):
            return _SURROGATE.sub("\ufffd", value)
        if isinstance(value, (list, tuple)):
            return [text(v) for v in value]
        return value

    def mapping(attrs: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None if attrs is None else {text(k): text(v) for k, v in attrs.items()}

    (trace_id, span_id, parent_id, name, kind, start_ns, end_ns, groups, events,
     status, message, trace_state) = record  # fmt: skip
    clean_groups = tuple(  # new mappings: plain groups, not CONSTANT (kept by identity)
        ("", mapping(lazy_mapping(attrs) if prefix == LAZY else attrs))
        if prefix in (CONSTANT, LAZY)
        else (text(prefix), mapping(attrs))
        for prefix, attrs in groups
    )
    clean_events = tuple((at, text(n), mapping(attrs)) for at, n, attrs in events)
    return (trace_id, span_id, parent_id, text(name), kind, start_ns, end_ns, clean_groups,
            clean_events, status, text(message), text(trace_state))  # fmt: skip
