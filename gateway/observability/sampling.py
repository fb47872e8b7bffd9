"""The tracer: which requests are traced, decided before anything is recorded.

Sampling. A request with a valid ``traceparent`` follows the caller's sampled flag and
continues its trace (``tracestate`` is kept and passed on). Any other request is traced with
probability ``sample_ratio``. An unsampled request gets, with ``trace_failures``, a
``DeferredRequestSpan`` that notes its start, decisions, breaches and upstream attempts, and is
recorded at its end only if it failed (status >= 500, the client's own 499 excepted) or
breached its budget, at most ``failure_traces_per_s`` a second (a token bucket), as a new trace
with ``gateway.trace.kept: failure`` and one CLIENT child per attempt (stage spans are not
kept); without it, the shared no-op span. The spans themselves: ``gateway.observability.spans``.

Open spans. The tracer counts the request spans begun and not yet ended (``Tracer.open``, two
integer steps a traced request): a reload that replaces the telemetry keeps the old export
running until they have ended (``Telemetry.drained``).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.observability.span_attributes import (
    OPERATION,
    REQUEST_ID,
    REQUEST_MODEL,
    REQUEST_PARAMS,
    capped,
)
from gateway.observability.span_records import SpanRecord
from gateway.observability.spans import NOOP_REQUEST, DeferredRequestSpan, RequestSpan

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_bits = random.getrandbits


class SpanSink(Protocol):
    """Where finished records go (``otlp.Exporter``; tests may pass a list's ``append``)."""

    def add(self, record: SpanRecord) -> None: ...


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``, None if it is not valid."""
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_hex, parent_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, parent_id = int(trace_hex, 16), int(parent_hex, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & 1)


class Tracer:
    def __init__(
        self,
        sink: SpanSink | None,
        *,
        record_content: bool = False,
        sample_ratio: float = 1.0,
        trace_failures: bool = False,
        failure_traces_per_s: float = 10.0,
    ) -> None:
        self.sink = sink
        self.enabled = sink is not None
        self.record_content = record_content
        self.sample_ratio = sample_ratio
        self.trace_failures = trace_failures
        self._failure_rate = failure_traces_per_s
        self._failure_tokens = max(failure_traces_per_s, 1.0)
        self._failure_refilled = time.monotonic()
        self.open = 0  # request spans begun and not ended (recorded, or deferred)

    def start_request(
        self,
        *,
        operation: str,
        request_model: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any] | None = None,
        started: float | None = None,
        request_id: str = "",
    ) -> RequestSpan:
        """The request's SERVER span (``operation``: chat, text_completion, embeddings);
        ``body`` gives the request parameters (max_tokens, temperature...), never the prompt;
        ``started``: ``time.perf_counter()`` when the request arrived (else now)."""
        if self.sink is None:
            return NOOP_REQUEST
        parent = None
        header = headers.get("traceparent")
        if header is not None:
            parent = parse_traceparent(header)
        if parent is None:
            if self.sample_ratio < 1.0 and random.random() >= self.sample_ratio:
                if self.trace_failures:
                    self.open += 1
                    return DeferredRequestSpan(self, operation, request_model, request_id, started)
                return NOOP_REQUEST
            trace_id, parent_id, state = _bits(128) or 1, 0, ""
        else:
            trace_id, parent_id, sampled = parent
            if not sampled:
                return NOOP_REQUEST
            state = headers.get("tracestate", "")
        model = capped(request_model)
        attrs: dict[str, Any] = {OPERATION: operation, REQUEST_MODEL: model}
        if request_id:
            attrs[REQUEST_ID] = request_id
        if body is not None:
            for field, name in REQUEST_PARAMS.items():
                value = body.get(field)
                if isinstance(value, (bool, int, float)):
                    attrs[name] = value
                elif isinstance(value, str):
                    attrs[name] = capped(value)
        self.open += 1
        span = RequestSpan(self, operation, f"{operation} {model}", trace_id, parent_id, state,
                           attrs)  # fmt: skip
        return _started(span, started)

    def take_failure_token(self) -> bool:
        """One failure trace from the bucket (refilled at ``failure_traces_per_s``)."""
        now = time.monotonic()
        cap = max(self._failure_rate, 1.0)
        self._failure_tokens = min(
            cap, self._failure_tokens + (now - self._failure_refilled) * self._failure_rate
        )
        self._failure_refilled = now
        if self._failure_tokens < 1.0:
            return False
        self._failure_tokens -= 1.0
        return True


def _started(span: RequestSpan, started: float | None) -> RequestSpan:
    """``span`` starting at ``started`` (``time.perf_counter()`` of the request's arrival)."""
    if started is not None:
        span.start_ns -= int((time.perf_counter() - started) * 1_000_000_000)
    return span
