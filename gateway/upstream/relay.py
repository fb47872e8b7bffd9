"""Send an answer back to the client: the one relay path.

Every answer leaves through here, whatever produced it: a live upstream attempt (plain,
hedged, or a cascade's tier) through ``relay``, a finished answer (a held small answer, a cache
hit) through ``send_answer``. The ``RelayPlan`` the orchestrator builds once per request
carries what must hold for all of them: the surface's deadline, the watchers of the bytes sent
(span summary, cache capture), the inter-token metric, the response headers.

Streams are relayed as they arrive (no SSE parsing, no re-encoding) through
``sse.Framing``: line ends become ``\n`` (an upstream may write ``\r\n`` or ``\r``; every
reader after it, the client included, then sees one framing), and an event left open past
``server.max_response_bytes`` or 4 MiB ends the stream (an error event, a 502 against the
replica: it holds memory and gives the client nothing). The relay notes when reads arrive
(TTFT, gaps between reads) and whether the stream ended with ``data: [DONE]`` (or
``data:[DONE]``). A stream request answered 200 with a whole JSON answer (a server that ignores
``stream``) is sent as the stream asked for, as ``send_answer`` renders finished answers; JSON
that is no answer is a 502 against the replica (any other non-SSE 200, a proxy's page, never
gets here: the opener moves on to another replica); a whole answer is read, and judged, by
``gateway.upstream.whole_answer``. A stream's Content-Type is always the gateway's
``text/event-stream``. Two clocks can end an answer early:

* the surface's deadline (``actions.deadline`` with ``budget.total_ms``): the relay stops the
  upstream and ends the stream as a model that hit ``max_tokens`` would, with a chunk whose
  ``finish_reason`` is ``length`` and ``data: [DONE]`` (a 200); a JSON answer not complete by
  then is a 504, and so is a stream with no chunk by then (its first chunk is read before it
  gets here: ``gateway.upstream.attempts``);
* the backend's ``timeouts.total_s``, a bound on any attempt: past it the stream ends with a
  final SSE error event (``timeout_error``, code ``total_timeout``; the text so far is cut, as
  with ``finish_reason: length``) and no ``[DONE]``, counted as a 504; a JSON answer is a 504.

An upstream failure after the first byte becomes a final SSE error event. A request in
another client API (the Responses API, Anthropic's Messages API: ``gateway.dialects``) brings a
``ClientDialect``: the watchers still read the chat bytes the upstream sent, while the client
reads them re-told by the dialect's encoder (or, for an untranslated passthrough, relayed as
they are), a stream is complete when the encoder saw its end (those APIs end with an event,
not ``[DONE]``), and errors, the deadline's stop and whole answers are written in the
dialect's format. A failure that repeats per request (a refused, unreadable or broken answer)
is logged at WARNING once per replica and kind every 10 s (``LogEvery``), naming
``backend/replica``. A client that goes away cancels the handler; the ``finally`` below then
closes the upstream connection, and vLLM aborts the request and frees its KV cache. Whatever
the end, the attempt is finished here (load guard released, span ended) exactly once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.errors import Unavailable, UpstreamError, UpstreamTimeout, stopping
from gateway.protocol.answers import render_sse
from gateway.protocol.sse import MAX_EVENT_BYTES, EventTooLong, Framing
from gateway.upstream.attempt import Attempt
from gateway.upstream.client import UpstreamResponse, UpstreamStreamError
from gateway.upstream.out import ClientDialect, StreamOut
from gateway.upstream.whole_answer import answer_limit, read_whole, warn_replica

# What of an upstream's head reaches the client: what its answer is, when to come back, and
# the provider's processing time and API version. Nothing hop-by-hop (or named in its
# Connection), no cookie, no Location naming an internal address, no CORS grant (the
# gateway's own ``server.cors`` decides), no account name (``openai-organization``), no
# provider rate limits (they describe the gateway's account; a limited tenant gets its own,
# from the gateway's limiter), and never the upstream's request id (the caller's id is the
# gateway's, RelayPlan.headers).
_RELAYED = frozenset(
    {"content-type", "retry-after", "retry-after-ms", "openai-processing-ms", "openai-version"}
)
Watcher = Callable[[bytes], None]


class StreamFilter(Protocol):
    """Rewrites a stream on its way out (``gateway.protocol.usage.UsageTap``)."""

    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


# Set once an answer's head went out: what goes wrong after that is told inside the answer.
ANSWER_STARTED = web.RequestKey("llm_gateway.answer_started", bool)


@dataclass(frozen=True, slots=True)
class RelayPlan:
    """How answers go back for one request (built once by the orchestrator)."""

    stream: bool
    chat: bool
    include_usage: bool
    deadline: float | None  # perf_counter of the surface's deadline (graceful stop)
    headers: dict[str, str]  # added to the response
    watchers: Sequence[Watcher] = ()  # fed every chunk of a stream as it arrives
    on_gap: Callable[[float], None] | None = None  # seconds between consecutive stream reads
    max_response_bytes: int = 64 * 1024 * 1024  # a non-streamed answer past this is a 502
    client: ClientDialect | None = None  # None: the client speaks the upstream's API
    filter: StreamFilter | None = None  # what the client gets of each chunk of a live stream
    # A whole answer (JSON, or a finished answer rendered as SSE), before its headers are sent:
    # returns headers to add (its cost).
    on_answer: Callable[[bytes, Attempt | None], Mapping[str, str]] | None = None
    # The usage charged for a stream the deadline stopped (chat's usage object): told in the
    # stream's end when the client's API carries usage, or it asked for the usage chunk.
    estimate: Callable[[], dict[str, Any]] | None = None


@dataclass(slots=True)
class RelayResult:
    # The answer's status, the one every count reads (metrics, access log, SLO, span, cache
    # fill, limits): a whole answer's is the status it was sent with (a 502 for one the
    # client's API cannot tell); a stream's is its head's, or how it ended after it (502/504
    # broken, 503 the drain, 499 the client gone).
    status: int
    body: bytes | None = None  # the whole answer of a non-streaming request
    first_at: float | None = None  # perf_counter of the first streamed bytes
    last_at: float | None = None
    reads: int = 0
    deadline_hit: bool = False
    stop_usage: dict[str, Any] | None = None  # what the deadline's stop was charged (chat's usage)
    live: bool = True  # False: a finished answer rendered by the gateway (held, cached)

    def mean_gap_ms(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.reads < 2:
            return None
        return (self.last_at - self.first_at) * 1000 / (self.reads - 1)


@dataclass(slots=True)
class Relayed:
    response: web.StreamResponse
    result: RelayResult
    attempt: Attempt | None  # None for a cache hit


def response_headers(upstream: UpstreamResponse, extra: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in _RELAYED}
    headers.update(extra)
    return headers


async def relay(request: web.Request, attempt: Attempt, plan: RelayPlan) -> Relayed:
    """Relay a live attempt's answer; the attempt is finished when this returns or raises."""
    ok = stopped = False
    try:
        if plan.stream and attempt.response.status == 200:
            if _whole_answer(attempt.response.headers):  # finishes the attempt once read
                return await _answer_as_stream(request, attempt, plan)
            response, result = await _relay_stream(request, attempt, plan)
        else:
            response, result = await _relay_body(attempt, plan)
        ok, stopped = result.status < 400, result.deadline_hit
        return Relayed(response, result, attempt)
    finally:
        attempt.finish(ok, stopped=stopped)


async def send_answer(
    request: web.Request, answer: bytes, plan: RelayPlan, attempt: Attempt | None = None
) -> Relayed:
    """A finished answer: as JSON, or as the SSE chunks of ``gateway.protocol.answers``."""
    client = plan.client
    status, body = 200, answer
    if not plan.stream and client is not None:
        status, body = client.render(200, answer)
    if attempt is not None:
        _untold(attempt, 200, status)
        attempt.finish(status < 400)
    headers = _answer_headers(plan, answer, attempt, status)
    if not plan.stream:
        if client is not None:
            await client.ended()
        response = web.Response(
            status=status, body=body, content_type="application/json", headers=headers
        )
        return Relayed(response, RelayResult(response.status, body=answer, live=False), attempt)
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    request[ANSWER_STARTED] = True
    first_at = time.perf_counter()
    data = json.loads(answer)
    chunks = render_sse(data, include_usage=plan.include_usage)
    # The watchers read it as they read a live stream: with its usage chunk (every stream is
    # asked for one), whether or not the client gets it.
    seen = chunks
    if plan.watchers and not plan.include_usage:
        seen = render_sse(data, include_usage=True)
    for chunk in seen:
        for watch in plan.watchers:
            watch(chunk)
    out = b"".join(chunks)
    if client is not None:
        encoder = client.stream()
        out = encoder.start() + encoder.feed(out)
        await client.ended()
    await resp.write(out)
    await resp.write_eof()
    result = RelayResult(200, first_at=first_at, last_at=first_at, reads=1, live=False)
    return Relayed(resp, result, attempt)


async def _relay_body(attempt: Attempt, plan: RelayPlan) -> tuple[web.Response, RelayResult]:
    """A non-streaming answer (or an upstream 4xx): read it whole, pass it on unchanged."""
    upstream = attempt.response
    body = await read_whole(attempt, plan.deadline, plan.max_response_bytes)
    status, out = upstream.status, body
    if plan.client is not None:
        status, out = plan.client.render(status, body)
        _untold(attempt, upstream.status, status)
        await plan.client.ended()
    headers = plan.headers
    if upstream.status < 400:
        headers = _answer_headers(plan, body, attempt, status)
    resp = web.Response(status=status, body=out, headers=response_headers(upstream, headers))
    return resp, RelayResult(resp.status, body=body)


def _untold(attempt: Attempt, upstream: int, sent: int) -> None:
    """An answer the client's API could not tell (``ClientDialect.render`` made a 502 of it)
    is the replica's failure, as an answer that does not parse is."""
    if sent >= 500 > upstream:
        attempt.fail("bad_answer", "an answer the client's API cannot tell")


def _answer_headers(
    plan: RelayPlan, answer: bytes, attempt: Attempt | None, sent: int
) -> dict[str, str]:
    """The headers of a whole answer: its usage is read for the limits whatever was sent (the
    upstream generated it), its cost is said only on an answer the client got."""
    if plan.on_answer is None:
        return plan.headers
    extra = plan.on_answer(answer, attempt)
    return {**plan.headers, **extra} if sent < 400 else plan.headers


def _noted(result: RelayResult, plan: RelayPlan, data: bytes, at: float) -> None:
    """A stream read: its time (first, gap since the last) and the watchers that see it."""
    if result.first_at is None:
        result.first_at = at
    elif plan.on_gap is not None and result.last_at is not None:
        plan.on_gap(at - result.last_at)
    result.last_at = at
    result.reads += 1
    for watch in plan.watchers:
        watch(data)


def _whole_answer(headers: Mapping[str, str]) -> bool:
    """A stream request answered whole, in JSON (a server that ignores ``stream``)."""
    return "json" in headers.get("Content-Type", "").lower()


async def _answer_as_stream(request: web.Request, attempt: Attempt, plan: RelayPlan) -> Relayed:
    """A whole JSON answer to a stream request, sent as the stream the client asked for (the
    chunks ``send_answer`` renders); a body that is no answer of the endpoint is the replica's
    failure, answered 502 before any byte went out."""
    body = await read_whole(attempt, plan.deadline, plan.max_response_bytes)
    kind = "chat.completion" if plan.chat else "text_completion"
    try:
        readable = json.loads(body).get("object") == kind
    except (ValueError, RecursionError):
        readable = False
    if not readable:
        warn_replica(
            attempt, "not_answer", "%s answered a stream request with JSON that is not an answer"
        )
        attempt.fail("bad_answer", "a stream request answered with JSON that is no answer")
        raise UpstreamError(
            "the upstream answered a stream request with JSON that is not an answer",
            code="bad_gateway",
        )
    return await send_answer(request, body, plan, attempt)


async def _relay_stream(
    request: web.Request, attempt: Attempt, plan: RelayPlan
) -> tuple[web.StreamResponse, RelayResult]:
    upstream = attempt.response
    headers = response_headers(upstream, plan.headers)
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    resp.headers["Content-Type"] = "text/event-stream"  # the gateway's, whatever the upstream's
    await resp.prepare(request)
    request[ANSWER_STARTED] = True
    result = RelayResult(upstream.status)
    out = StreamOut(resp, plan.client, attempt.where)
    finished = False
    keep = plan.filter  # takes the usage chunk out for a client that did not ask for it
    # Line ends made "\n" before anyone reads the bytes, and no event past the cap.
    framing = Framing(min(plan.max_response_bytes, MAX_EVENT_BYTES))

    limit, ours = answer_limit(attempt, plan.deadline)
    try:
        await out.begin()
        if attempt.first:
            first = framing.feed(attempt.first)
            _noted(result, plan, first, attempt.first_at or time.perf_counter())
            await out.write(first if keep is None else keep.feed(first))
        window = asyncio.timeout(max(limit - time.perf_counter(), 0.0))
        try:
            async with window:
                # Per chunk: frame it, note it (plain calls, no coroutine), send it.
                async for data in upstream.content.iter_any():
                    data = framing.feed(data)
                    _noted(result, plan, data, time.perf_counter())
                    await out.write(data if keep is None else keep.feed(data))
        except TimeoutError:
            if not window.expired():  # not the clocks: uvloop may fire a little early
                raise  # the upstream went silent (idle_s), not a deadline
            if ours:
                result.deadline_hit = True
                if plan.estimate is not None:  # the span says it, told to the client or not
                    result.stop_usage = plan.estimate()
                told = plan.client is not None or plan.include_usage
                await out.stop(plan.chat, result.stop_usage if told else None)
                return resp, result
            result.status = 504
            message = "the answer ran past the backend's timeouts.total_s"
            await out.error(UpstreamTimeout(message, code="total_timeout"))
            return resp, result
        finished = True
        if keep is not None and (rest := keep.flush()):
            await out.write(rest)
        if out.failed:
            result.status = 502  # the upstream told of its failure, and the client read it
            attempt.fail("stream_error", "an error in the stream")
        elif not out.complete:
            result.status = 502
            attempt.fail("answer_broken", "a stream that ended early")
            await out.error(UpstreamError(f"the upstream stream ended before {out.end_name}"))
    except EventTooLong as exc:  # an event that never ends: memory held, nothing for the client
        result.status = 502
        attempt.fail("bad_answer", "an SSE event that never ended")
        await out.error(UpstreamError(f"the upstream stream sent {exc}"))
    except UpstreamStreamError as exc:  # the upstream said why (e.g. Anthropic's error event)
        result.status = 502
        attempt.fail("stream_error", "an error in the stream")
        await out.error(UpstreamError(str(exc)))
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        result.status = 502
        attempt.fail("answer_broken", "the connection broke during the stream")
        await out.error(UpstreamError("the upstream connection broke during the stream"))
    except TimeoutError:
        result.status = 504
        attempt.fail("idle_timeout", "the stream stopped coming (idle_s)")
        message = "the upstream stopped sending (the backend's timeouts.idle_s)"
        await out.error(UpstreamTimeout(message, code="idle_timeout"))
    except ConnectionResetError:
        result.status = 499  # the client went away mid-write
        return resp, result
    except asyncio.CancelledError as exc:
        if not out.complete and stopping(exc):  # the drain's bound: the client is told
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            result.status = 503  # not the replica's failure: nothing is counted against it
            message = "the gateway is shutting down: the answer was cut short"
            await out.error(Unavailable(message, code="shutting_down"))
            # Ended like any other error (a 503 the gateway ended, not a client that left).
        elif not out.complete:
            raise  # the client went away before the end
        else:
            # Every byte up to the end was handed over and the client closed, as clients may,
            # while the upstream's end of body was awaited: a complete answer, the cancel
            # absorbed.
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            return resp, result
    finally:
        # Anything but a clean end (an error, a deadline, the client leaving, a cancelled
        # handler) closes the upstream connection, so the replica aborts the request.
        if finished:
            upstream.release()
        else:
            upstream.close()
    try:
        await resp.write_eof()
    except ConnectionResetError:
        if not out.complete:  # a client that read the end may close before the end of body
            result.status = 499
    return resp, result
