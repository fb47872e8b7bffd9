"""A whole (non-streamed) answer read from the upstream, by its time limits, and judged.

Every reader of a whole answer (the relay, the cascade's small tier, the cache audit) reads it
through ``read_whole``, so one rule says what is an answer and whose failure a bad one is: a
body that breaks off, stops coming for ``idle_s``, does not parse, or is a 200 that is not a
JSON object (a proxy's page) or that tells an error is the replica's failure; an answer over
``server.max_response_bytes`` or past a time limit is not. The time limit of an answer, whole or
streamed, is ``answer_limit``: the earlier of the surface's deadline and the backend's
``timeouts.total_s``.

A failure that repeats per request is logged at WARNING once per replica and kind every 10 s
(``warn_replica``, one ``LogEvery`` for these and the relay's, naming ``backend/replica``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import aiohttp

from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.observability.log_every import LogEvery
from gateway.protocol import upstream_json
from gateway.upstream.attempt import Attempt
from gateway.upstream.client import AnswerTooLarge, UpstreamResponse, read_capped
from gateway.upstream.providers.translated import TranslatedResponse
from routing.http1_response import Http1Response

log = logging.getLogger("llm_gateway.relay")
_per_replica = LogEvery(log)  # a replica that fails one answer so fails them all


def warn_replica(attempt: Attempt, kind: str, msg: str, *args: object) -> None:
    """``msg`` (its first ``%s``: the replica) once per replica and ``kind`` every 10 s."""
    _per_replica.warning((attempt.where, kind), msg, attempt.where, *args)


async def read_whole(attempt: Attempt, deadline: float | None, max_bytes: int) -> bytes:
    """A non-streamed answer (or a 4xx's body) read whole, by ``deadline`` and ``total_s``.

    Every reader of a whole answer (the relay, the cascade's small tier, the cache audit) reads
    it here: an answer that breaks off, stops coming for ``idle_s``, does not parse or is a 200
    that is not a JSON object is flagged as the replica's failure (``Attempt.failure``); an
    answer over ``max_bytes`` or past a time limit is not. Each ends the connection and raises
    the ``GatewayError`` to answer with; the attempt is still the caller's to finish.
    """
    upstream = attempt.response
    limit, ours = answer_limit(attempt, deadline)
    window: asyncio.Timeout | None = None
    try:
        body = upstream.whole(max_bytes) if isinstance(upstream, Http1Response) else None
        if body is None:  # not all here yet: read it under the time limit
            async with asyncio.timeout(max(limit - time.perf_counter(), 0.0)) as window:
                body = await read_answer(upstream, max_bytes)
    except AnswerTooLarge as exc:
        upstream.close()
        warn_replica(
            attempt,
            "too_large",
            "an answer from %s was refused: %s (server.max_response_bytes)",
            exc,
        )
        raise UpstreamError(
            "the upstream's answer is larger than server.max_response_bytes",
            code="response_too_large",
        ) from exc
    except TimeoutError as exc:
        upstream.close()
        # Which timer fired: the limit's own (uvloop may fire it a little before perf_counter
        # reaches the limit, so the clocks are not compared), else the reads' idle_s.
        if window is None or not window.expired():  # the upstream went silent between reads
            attempt.fail("idle_timeout", "the answer stopped coming (idle_s)")
            raise UpstreamTimeout(
                "the upstream stopped sending its answer (the backend's timeouts.idle_s)",
                code="idle_timeout",
            ) from exc
        why = "the surface's total_ms budget" if ours else "the backend's timeouts.total_s"
        raise UpstreamTimeout(
            f"the upstream's answer did not complete within {why}", code="total_timeout"
        ) from exc
    except aiohttp.ClientError as exc:
        upstream.close()
        attempt.fail("answer_broken", "the connection broke during the answer")
        raise UpstreamError(
            "the upstream connection broke while sending the answer", code="bad_gateway"
        ) from exc
    except ValueError as exc:  # a translated answer (another API's) that does not parse
        upstream.close()
        attempt.fail("bad_answer", "an unreadable answer")
        raise UpstreamError("the upstream's answer could not be read", code="bad_gateway") from exc
    except BaseException:  # the client left (cancelled) mid-read: the replica must see it too
        upstream.close()
        raise
    upstream.release()
    if attempt.first:  # a hedged stream request's first read, answered whole
        body = attempt.first + body
    if upstream.status == 200 and not _json_object(body, upstream.headers):
        # An HTML error page from a proxy, or a body cut short: not an answer.
        warn_replica(attempt, "not_json", "%s answered 200 with a body that is not a JSON object")
        attempt.fail("bad_answer", "an answer that is not JSON")
        raise UpstreamError(
            "the upstream answered 200 with a body that is not a JSON answer", code="bad_gateway"
        )
    if upstream.status == 200 and b'"error"' in body and _error_object(body):
        # A provider (or a proxy) that tells its failure with a 200: not an answer either.
        warn_replica(attempt, "error_200", "%s answered 200 with an error object")
        attempt.fail("bad_answer", "an error object answered 200")
        raise UpstreamError(
            "the upstream answered 200 with an error object, not an answer", code="bad_gateway"
        )
    return body


def _error_object(body: bytes) -> bool:
    """An error told with a 200: ``{"error": ...}`` (OpenAI's shape; Anthropic's adds ``type:
    error``) and none of an answer's parts (a Responses object has ``error: null``, a failed
    one its ``output`` beside it)."""
    try:
        data = upstream_json.loads(body)
    except ValueError:
        return False
    return (
        isinstance(data, dict)
        and data.get("error") is not None
        and not any(key in data for key in _ANSWER_KEYS)
    )


_ANSWER_KEYS = ("choices", "output", "content", "data")  # chat/completions, Responses, Messages


def _json_object(body: bytes, headers: Mapping[str, str]) -> bool:
    """Cheap shape check of a 200 answer (the bytes pass on unparsed): a JSON object, whole."""
    ctype = headers.get("Content-Type", "application/json").lower()
    if "json" not in ctype:
        return False
    stripped = body.strip()
    return stripped.startswith(b"{") and stripped.endswith(b"}")


async def read_answer(upstream: UpstreamResponse, max_bytes: int) -> bytes:
    """A whole (non-streamed) answer, at most ``max_bytes`` as it comes from the upstream."""
    if isinstance(upstream, (Http1Response, aiohttp.ClientResponse)):
        return await read_capped(upstream, max_bytes)
    if isinstance(upstream, TranslatedResponse):
        return await upstream.read(max_bytes)
    return await upstream.read()


def answer_limit(attempt: Attempt, deadline: float | None) -> tuple[float, bool]:
    """The earlier of the surface's deadline and ``total_s``; True when it is the surface's."""
    hard = attempt.total_deadline
    if deadline is not None and deadline <= hard:
        return deadline, True
    return hard, False
