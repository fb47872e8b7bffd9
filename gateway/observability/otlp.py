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
before it, at the cost of one comparison. The loop and the thread may encode at once, so room
is reserved under the lock before a span is queued, ``_RESERVE`` bytes at a time (a chunk of
spans without content takes one), and what a pass did not use is given back at its end: the
two never hold more than the bound together, at the cost of dropping a span early near it
(at most ``_RESERVE`` of room reserved by the other). A failed send is retried once after
``retry_s``; then the batch is dropped and counted. A batch sent whole that the collector did
not answer for within the sender's timeout (10 s) may have been received: it is not sent again
(a collector does not remove duplicates) and is counted apart (``unconfirmed``), not as dropped.
The counts are exported as ``llm_gateway_trace_spans_dropped_total`` and
``llm_gateway_trace_spans_unconfirmed_total`` (``tracing.SpanDropCollector``).

Beside it: the record format (``gateway.observability.span_records``), the encoding
(``gateway.observability.otlp_encoding``) and the senders (``gateway.observability.otlp_senders``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sized
from typing import Any

from gateway.observability.log_every import LogEvery
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.otlp_senders import Sender, Unconfirmed
from gateway.observability.span_records import SpanRecord

log = logging.getLogger("llm_gateway.tracing")

# A batch holds at most this many bytes of encoded spans (and at least one span): well under a
# collector's usual limit on a request (the OpenTelemetry Collector's: 20 MiB).
BATCH_BYTES = 4 * 1024 * 1024
# Encoded spans the export holds at most (waiting, and the batch being sent): a span without
# content is a few hundred bytes, so the count bound (8,192) comes first unless spans carry
# content (``record_content``: up to 8,192 characters an attribute).
MAX_QUEUE_BYTES = 16 * 1024 * 1024
_CHUNK = 32  # records encoded by one loop callback...
_CHUNK_S = 0.001  # ...unless it has taken this long (an answer of 64 KiB takes ~0.3 ms to read)
_RESERVE = 64 * 1024  # bytes of room an encoding pass reserves at a time (at least a span's)


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
        reserved = added = 0  # bytes of room this pass holds, and of them used
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
                size = len(item)
                if added + size > reserved:
                    reserved += self._reserve(added + size - reserved)
                    if added + size > reserved:
                        self._drop_full()
                        continue
                added += size
                ready(item)
                if deadline is not None and time.perf_counter() > deadline:
                    return
        finally:
            with self._idle:
                self.held_bytes -= reserved - added
                self._in_flight -= 1
                self._idle.notify_all()

    def _reserve(self, need: int) -> int:
        """Take room for ``need`` more bytes and some to spare (up to ``_RESERVE``) from the
        bound, under the lock; 0 if less than ``need`` is free."""
        with self._idle:
            free = self._max_bytes - self.held_bytes
            if free < need:
                return 0
            taken = min(free, max(need, _RESERVE))
            self.held_bytes += taken
            return taken

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
