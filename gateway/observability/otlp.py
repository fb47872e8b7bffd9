"""OTLP trace export of span records: protobuf encoding in chunks on the loop, sending in a thread.

The event loop appends finished span records (plain tuples, ``SpanRecord``) to a bounded queue;
every ``chunk`` records (32), one loop callback turns them into OTLP ``Span`` bytes (stopping
early once it has held the loop for a millisecond: long answers to summarise), and this
module's thread joins those into an ``ExportTraceServiceRequest`` and sends it over HTTP
(``POST /v1/traces``, ``application/x-protobuf``) or gRPC (``TraceService/Export``), the wire
format of ``opentelemetry-proto`` (tests decode what is sent with its generated classes).

Why the loop encodes: on the gateway's one core, a thread that encodes has to take the GIL from
the loop again and again (it yielded between slices so the loop was never held up long), and
each hand-over cost more than the encoding it let through (``docs/benchmarks.md``: slices of 8
spans cost ~40 us a request more than slices of 64). A callback after every 32 records holds the
loop for about 0.3 ms, keeps the encoder's caches warm across its records, and never waits for
the GIL; the thread takes the GIL only to post a batch. Records that never fill a chunk (a quiet
gateway) are encoded by the thread when it wakes.

Encoding is written out by hand against the proto field numbers: a span is a handful of
length-delimited fields. Most of its attributes repeat from one request to the next (operation,
model, tenant, surface, backend, replica, server address), so a group of them that repeats is
kept encoded whole and costs one lookup; the rest (ids, token counts, timings) are written
straight from their values (``Encoder``).

Batches: the thread wakes every ``schedule_s`` (or as soon as ``batch_size`` spans are ready)
and sends up to ``batch_size`` spans (and ``BATCH_BYTES`` of them) per request (``Exporter``
delivers any batch function: OTLP here, or a caller's OpenTelemetry SDK exporter in
``gateway.observability.tracing``, which gets the records themselves). At most ``max_queue``
spans wait, encoded or not, and at most ``max_queue_bytes`` of encoded spans are held, waiting
or in the batch being sent: with ``record_content`` a span carries up to 8,192 characters per
attribute, and 8,192 such spans held for a hung collector would be ~64 MB. (The bytes are
counted once encoded: records waiting for their loop callback, a chunk or so, are not, nor the
records a caller's exporter takes, whose size is not known.) Beyond either bound spans are
dropped and counted (``dropped``; a warning is logged when the queue fills): a span that does
not fit is dropped once encoded, and while the bytes are at the bound new spans are dropped
before it, at the cost of one comparison. A failed send is retried once after ``retry_s``; then
the batch is dropped and counted. A batch sent whole that the collector did not answer for
within the sender's timeout (10 s) may have been received: it is not sent again (a collector
does not remove duplicates) and is counted apart (``unconfirmed``), not as dropped. The counts
are exported as ``llm_gateway_trace_spans_dropped_total`` and
``llm_gateway_trace_spans_unconfirmed_total`` (``tracing.SpanDropCollector``).
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway.observability.log_every import LogEvery

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
_CACHE_MAX = 8192
# What a cache keeps is bounded in bytes too, not only in entries: a string longer than this
# (characters), or a group or array whose encoding is longer (bytes), is encoded each time and
# never kept, so one odd span (a caller's 4 MB model name) cannot pin memory in 8192 entries.
_KEEP_MAX = 512
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
# A batch holds at most this many bytes of encoded spans (and at least one span): well under a
# collector's usual limit on a request (the OpenTelemetry Collector's: 20 MiB).
BATCH_BYTES = 4 * 1024 * 1024
# Encoded spans the export holds at most (waiting, and the batch being sent): a span without
# content is a few hundred bytes, so the count bound (8,192) comes first unless spans carry
# content (``record_content``: up to 8,192 characters an attribute).
MAX_QUEUE_BYTES = 16 * 1024 * 1024
_CHUNK = 32  # records encoded by one loop callback...
_CHUNK_S = 0.001  # ...unless it has taken this long (an answer of 64 KiB takes ~0.3 ms to read)
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


# --- protobuf wire encoding ------------------------------------------------------------------


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
                attrs = _evaluated(attrs)
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
        ("", mapping(_evaluated(attrs) if prefix == LAZY else attrs))
        if prefix in (CONSTANT, LAZY)
        else (text(prefix), mapping(attrs))
        for prefix, attrs in groups
    )
    clean_events = tuple((at, text(n), mapping(attrs)) for at, n, attrs in events)
    return (trace_id, span_id, parent_id, text(name), kind, start_ns, end_ns, clean_groups,
            clean_events, status, text(message), text(trace_state))  # fmt: skip


def _evaluated(group: Any) -> Mapping[str, Any]:
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
        attrs = _evaluated(group) if prefix == LAZY else group
        for key, value in attrs.items():
            if value is not None:
                merged[prefix + key if prefix and prefix not in (CONSTANT, LAZY) else key] = value
    return merged


# --- sending ---------------------------------------------------------------------------------


class Sender(Protocol):
    def send(self, body: bytes) -> None: ...

    def close(self) -> None: ...


class Unconfirmed(OSError):
    """A batch was sent whole but the collector did not answer in time: it may have been
    received. It is not sent again (that would duplicate its spans), nor counted as dropped."""


class HttpSender:
    """OTLP/HTTP: ``POST {endpoint}`` with a kept-alive connection (http.client, this thread)."""

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> None:
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path or "/v1/traces"
        self._headers = {"Content-Type": "application/x-protobuf", **headers}
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def send(self, body: bytes) -> None:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        try:
            self._conn.request("POST", self._path, body, self._headers)
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        try:
            resp = self._conn.getresponse()
            resp.read()
        except TimeoutError as exc:  # sent whole, no answer in time
            self.close()
            raise Unconfirmed(f"no answer from the OTLP receiver in {self._timeout} s") from exc
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if resp.status >= 300:
            raise OSError(f"OTLP receiver answered {resp.status}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcSender:
    """OTLP/gRPC: the ``TraceService/Export`` unary call with the encoded request as its bytes."""

    METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> None:
        import grpc  # type: ignore[import-untyped]

        parts = urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
        target = f"{parts.hostname}:{parts.port or 4317}"
        self._channel = (
            grpc.insecure_channel(target)
            if parts.scheme == "http"
            else grpc.secure_channel(target, grpc.ssl_channel_credentials())
        )
        self._call = self._channel.unary_unary(self.METHOD)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout = timeout_s
        self._rpc_error: Any = grpc.RpcError  # untyped: its code() is not known to mypy
        self._deadline_exceeded = grpc.StatusCode.DEADLINE_EXCEEDED

    def send(self, body: bytes) -> None:
        try:
            self._call(body, timeout=self._timeout, metadata=self._metadata)
        except self._rpc_error as exc:
            if exc.code() == self._deadline_exceeded:
                raise Unconfirmed(f"no answer from the OTLP receiver in {self._timeout} s") from exc
            raise

    def close(self) -> None:
        self._channel.close()


Deliver = Callable[[list[Any]], None]  # a batch of what ``prepare`` made (else of records)


def otlp_delivery(sender: Sender, encoder: Encoder) -> Deliver:
    """Send a batch of encoded spans as one ``ExportTraceServiceRequest`` (raises on failure)."""

    def deliver(spans: list[bytes]) -> None:
        sender.send(encoder.request(spans))

    return deliver


class Exporter:
    """The bounded queue the event loop appends to, and the thread that delivers batches.

    With ``prepare`` (OTLP: ``Encoder.span``), a record is turned into what ``deliver`` takes
    on the loop, ``chunk`` records per callback (module comment); without it the thread
    delivers the records themselves.
    """

    def __init__(
        self,
        deliver: Deliver,
        *,
        prepare: Callable[[SpanRecord], Sized] | None = None,  # its len(): bytes held
        chunk: int = _CHUNK,
        schedule_s: float = 1.0,
        batch_size: int = 512,
        batch_bytes: int = BATCH_BYTES,
        max_queue: int = 8192,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        retry_s: float = 1.0,
        close: Callable[[], None] | None = None,
    ) -> None:
        self._deliver = deliver
        self._prepare = prepare
        self._chunk = chunk
        self._close = close
        self._records: collections.deque[SpanRecord] = collections.deque()  # to prepare
        self._queue: collections.deque[Any] = collections.deque()  # ready to deliver
        self._scheduled = False  # a loop callback will prepare the waiting records
        self._schedule_s = schedule_s
        self._batch_size = batch_size
        self._batch_bytes = batch_bytes
        self._max_queue = max_queue
        self._max_bytes = max_queue_bytes
        # bytes of encoded spans held, waiting or being sent (changed under ``_idle``)
        self.held_bytes = 0
        self._retry_s = retry_s
        self._failures = LogEvery(log)  # one line per 10 s while the collector is down
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._stopping = False
        self.dropped = 0  # full queue, failed encoding, failed send (read by /metrics)
        self.unconfirmed = 0  # sent, but the collector did not answer in time
        self.exported = 0
        self._full = False
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    @classmethod
    def otlp(cls, sender: Sender, encoder: Encoder, **settings: Any) -> Exporter:
        return cls(
            otlp_delivery(sender, encoder), prepare=encoder.span, close=sender.close, **settings
        )

    def add(self, record: SpanRecord) -> None:
        """On the event loop: one append (a callback per ``chunk`` records, a wake-up per
        batch)."""
        records = self._records
        if len(records) + len(self._queue) >= self._max_queue or self.held_bytes >= self._max_bytes:
            self._drop_full()  # by bytes: before it is encoded
            return
        self._full = False
        if self._prepare is None:
            self._ready(record)
            return
        records.append(record)
        if len(records) >= self._chunk and not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop on this thread: the export thread encodes them
                if len(records) >= self._batch_size:
                    self._wake.set()
                return
            self._scheduled = True
            loop.call_soon(self._prepare_chunk)

    def _drop_full(self) -> None:
        self.dropped += 1
        # Told once per spell of a full queue, not once per span, and at most once per 10 s:
        # spells by bytes can be short (a large span dropped, a small one queued).
        if not self._full:
            self._full = True
            self._failures.warning(
                "full",
                "the trace export queue is full (%d spans or %d bytes): spans are dropped and"
                " counted in llm_gateway_trace_spans_dropped_total",
                self._max_queue, self._max_bytes,
            )  # fmt: skip

    def _ready(self, item: Any) -> None:
        queue = self._queue
        queue.append(item)
        if len(queue) >= self._batch_size and not self._wake.is_set():
            self._wake.set()

    def _prepare_chunk(self) -> None:
        """A loop callback: prepare one chunk; another callback if more are waiting."""
        self._scheduled = False
        self._prepare_waiting(self._chunk, time.perf_counter() + _CHUNK_S)
        if len(self._records) >= self._chunk:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._prepare_chunk)

    def _prepare_waiting(self, limit: int | None = None, deadline: float | None = None) -> None:
        """Prepare up to ``limit`` waiting records (all without one), stopping after the one
        that passes ``deadline`` (``time.perf_counter``); the loop and the thread may both be
        at it: each record is popped by one of them."""
        records, prepare, ready = self._records, self._prepare, self._ready
        if prepare is None or not records:
            return
        with self._idle:  # a record taken but not yet queued still counts for force_flush
            self._in_flight += 1
        room = self._max_bytes - self.held_bytes  # the lock is taken once, at the end
        added = 0
        try:
            n = 0
            while records and (limit is None or n < limit):
                try:
                    record = records.popleft()
                except IndexError:  # the other one took the last
                    return
                n += 1
                try:
                    item = prepare(record)
                except Exception:  # a record that cannot be encoded is lost, never the others
                    self.dropped += 1
                    log.exception("a span could not be encoded")
                    continue
                if added + len(item) > room:
                    self._drop_full()
                    continue
                added += len(item)
                ready(item)
                if deadline is not None and time.perf_counter() > deadline:
                    return
        finally:
            with self._idle:
                self.held_bytes += added
                self._in_flight -= 1
                self._idle.notify_all()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._schedule_s)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        self._prepare_waiting()  # what never filled a chunk
        queue = self._queue
        while queue:
            with self._idle:
                self._in_flight += 1
            try:
                batch: list[Any] = []
                size = 0  # bytes of encoded spans (a caller's deliver takes records: 0)
                while queue and len(batch) < self._batch_size and size < self._batch_bytes:
                    item = queue.popleft()
                    batch.append(item)
                    size += len(item) if isinstance(item, bytes) else 0
                self._send(batch)
            finally:
                with self._idle:
                    self.held_bytes -= size
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _send(self, batch: list[Any]) -> None:
        for attempt in range(2):
            try:
                self._deliver(batch)
            except Unconfirmed as exc:  # maybe received: neither sent again nor dropped
                self.unconfirmed += len(batch)
                self._failures.warning(
                    "export", "trace export unconfirmed, %d spans not sent again: %s",
                    len(batch), exc,
                )  # fmt: skip
            except Exception as exc:  # any transport error: retry once, then drop the batch
                if attempt == 0 and not self._stopping:
                    time.sleep(self._retry_s)
                    continue
                self.dropped += len(batch)
                self._failures.warning(
                    "export", "trace export failed, %d spans dropped: %s", len(batch), exc
                )
            else:
                self.exported += len(batch)
            return

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Block until every queued span was delivered (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        with self._idle:
            while self._queue or self._records or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()
                self._idle.wait(min(left, 0.05))
        return True

    @property
    def stopped(self) -> bool:
        """Its thread has ended (``shutdown``): ``dropped`` will not change again."""
        return not self._thread.is_alive()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._close is not None:
            self._close()


def sender_for(protocol: str, endpoint: str, headers: Mapping[str, str]) -> Sender:
    return GrpcSender(endpoint, headers) if protocol == "grpc" else HttpSender(endpoint, headers)
