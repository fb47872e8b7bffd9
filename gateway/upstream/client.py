"""Open a request to one replica, mapping library errors to the gateway's own at the boundary.

An attempt has two phases: until the response headers arrive (``first_byte_s``; failures here
may be retried on another replica) and the body (``idle_s`` between reads, ``total_s`` in all).
Only the first phase lives here; the relay reads the body.

A request goes through the pool's lean HTTP/1.1 client (``routing.http1``) when the replica has
one (a vLLM backend's ``http://`` replicas), else through aiohttp's; both raise aiohttp's
exception types and give a response the relay reads alike.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from policies.backends import TimeoutConfig
from routing.http1 import Http1Pool
from routing.http1_errors import CannotConnect, NoFreeConnection
from routing.http1_response import Http1Response
from routing.pool import BackendPool
from routing.replica import Replica

# Headers from the client that travel upstream (the client's API key never does).
# (anthropic-beta: the features a client of Anthropic's API opts into; other backends ignore it.)
FORWARDED_HEADERS = (
    "traceparent",
    "tracestate",
    "x-vllm-priority",
    "anthropic-beta",
)


class AttemptFailed(Exception):
    """The attempt failed before any byte of the body; ``retryable`` says if another may help.

    ``str(exc)`` names the replica (for the operator's log); ``public`` is what a caller may
    read: no address, host or port of an upstream.
    """

    def __init__(self, outcome: str, message: str, retryable: bool, public: str = "") -> None:
        super().__init__(message)
        # metric label: connect_error | http_5xx | timeout | rejected_key | bad_status | bad_answer
        # | no_connection (the gateway's own connections to the replica were all busy: not the
        # replica's failure)
        self.outcome = outcome
        self.retryable = retryable
        self.public = public or _PUBLIC.get(outcome, "the upstream failed")
        self.attempts = 1  # 2: a hedge was sent beside it and failed too


_PUBLIC = {
    "connect_error": "the upstream could not be reached",
    "http_5xx": "the upstream answered with a server error",
    "timeout": "the upstream did not answer in time",
    "rejected_key": "the upstream rejected the gateway's credentials",
    "http_429": "the upstream is rate limited",
    "bad_status": "the upstream answered with a status that is not an API answer",
    "bad_answer": "the upstream answered a stream request with neither a stream nor an answer",
    "no_connection": "every connection of the gateway to the upstream is busy",
}


_UNREADABLE = (
    "the upstream's answer could not be read (malformed, or in a Content-Encoding "
    "the gateway does not decode)"
)


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A non-streamed answer over ``server.max_response_bytes``."""


async def read_capped(resp: aiohttp.ClientResponse | Http1Response, limit: int) -> bytes:
    """The whole body of ``resp``, refused (``AnswerTooLarge``) past ``limit`` bytes."""
    length = resp.content_length
    if length is not None and length > limit:
        raise AnswerTooLarge(f"the answer is {length} bytes")
    parts: list[bytes] = []
    size = 0
    while chunk := await resp.content.readany():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"the answer is over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class UpstreamStreamError(aiohttp.ClientPayloadError):
    """The upstream reported an error in the middle of a stream (e.g. Anthropic's ``error``)."""


class UpstreamBody(Protocol):
    async def readany(self) -> bytes: ...

    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamResponse(Protocol):
    """What the relay reads of an upstream answer: aiohttp's response, or a translating adapter
    (``gateway.providers.translated``) for a backend that speaks another API."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content(self) -> UpstreamBody: ...

    async def read(self) -> bytes: ...

    def release(self) -> object: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    path: str  # "chat/completions", "completions", "embeddings" or a provider's ("messages")
    body: bytes
    headers: CIMultiDict[str]


@functools.lru_cache(maxsize=64)
def _client_timeout(timeouts: TimeoutConfig) -> aiohttp.ClientTimeout:
    """Built once per backend's settings (frozen, hashable), not per request.

    aiohttp's ``sock_read`` bounds every wait for bytes, the response's head included: it is
    ``first_byte_s`` until the head came (an API that answers whole sends its head only then),
    and ``idle_s`` from then on (``_idle_from_now``)."""
    return aiohttp.ClientTimeout(
        total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.first_byte_s
    )


def _idle_from_now(resp: aiohttp.ClientResponse, idle_s: float) -> None:
    """The head came: the body's reads wait at most ``idle_s`` each, from now (the connection's
    read timer is re-armed as each read comes; the next request on it sets its own again)."""
    connection = resp.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is not None:
        protocol.read_timeout = idle_s
        if not resp.content.is_eof():  # at its end, aiohttp drops the timer (none to re-arm)
            protocol.start_timeout()  # from now: the head's bytes were under first_byte_s


@functools.lru_cache(maxsize=1024)
def _url(base_url: str, path: str) -> URL:
    """Parsed once per replica and path (aiohttp would parse the string on every request)."""
    return URL(f"{base_url}/{path}")


@functools.lru_cache(maxsize=1024)
def _target(base_url: str, path: str) -> str:
    """The request target the lean client sends (the replica's base path and ``path``)."""
    return f"{urlsplit(base_url).path}/{path}"


async def open_upstream(
    pool: BackendPool,
    replica: Replica,
    req: UpstreamRequest,
    timeouts: TimeoutConfig,
    first_byte_s: float,
) -> aiohttp.ClientResponse | Http1Response:
    """POST to ``replica``; returns a response with status < 500 whose body is unread.

    ``first_byte_s`` bounds the wait for the response headers (the backend's ``first_byte_s``,
    or less when the surface's deadline is nearer), a wait for a free connection included: one
    that ends with every connection busy is outcome ``no_connection``, never the replica's
    failure. The lean client knows when that happens; for aiohttp's connector it is read from
    the replica's load (the caller's ``LoadGuard`` counted, hence ``>``): a request sent with
    every connection taken queued for one.
    """
    wire = pool.wire(replica)
    queued = False
    try:
        if wire is not None:
            resp: aiohttp.ClientResponse | Http1Response = await _lean(
                wire, replica, req, timeouts, first_byte_s
            )
        else:
            queued = replica.outstanding > pool.settings.max_connections
            async with asyncio.timeout(first_byte_s):
                resp = await pool.session.post(
                    _url(replica.base_url, req.path),
                    data=req.body,
                    headers=req.headers,
                    timeout=_client_timeout(timeouts),
                    allow_redirects=False,  # a redirect would carry the prompt elsewhere
                )
            _idle_from_now(resp, timeouts.idle_s)
    except aiohttp.ConnectionTimeoutError as exc:  # the lean client's ConnectTimeout too
        # Nothing was sent: another replica may answer, and the wait was only connect_s.
        raise AttemptFailed(
            "connect_error", f"cannot connect to {replica.name} within connect_s", True
        ) from exc
    except NoFreeConnection as exc:
        raise AttemptFailed("no_connection", f"no free connection to {replica.name}", True) from exc
    except TimeoutError as exc:
        if queued:
            raise AttemptFailed(
                "no_connection", f"no free connection to {replica.name} in time", True
            ) from exc
        raise AttemptFailed("timeout", f"{replica.name} did not answer in time", False) from exc
    except (aiohttp.ClientConnectorError, CannotConnect) as exc:
        raise AttemptFailed("connect_error", f"cannot connect to {replica.name}", True) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise AttemptFailed("connect_error", f"{replica.name} closed the connection", True) from exc
    except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as exc:
        # It answered, with a head that does not parse or in an encoding the gateway neither
        # asked for nor decodes (brotli): a bad answer (for one model), not a connect error.
        raise AttemptFailed(
            "bad_answer", f"{replica.name}: {exc}", True, public=_UNREADABLE
        ) from exc
    except aiohttp.ClientError as exc:
        raise AttemptFailed("connect_error", f"{replica.name}: {exc}", True) from exc
    if resp.status >= 500:
        resp.release()
        raise AttemptFailed("http_5xx", f"{replica.name} answered {resp.status}", True)
    if resp.status != 200 and resp.status < 400:
        # An API answers 200 or an error: a redirect (its Location names an address of ours),
        # a 204 or a 1xx is a proxy's or a misconfiguration's, and never reaches the caller.
        resp.close()
        raise AttemptFailed("bad_status", f"{replica.name} answered {resp.status}", True)
    if resp.status in (401, 403):
        resp.release()
        raise rejected_key(replica.name, resp.status)
    return resp


def rejected_key(replica: str, status: int) -> AttemptFailed:
    """A 401/403. The caller's key never travels upstream: it refuses the gateway's own (or its
    lack of one). Not the caller's fault (a 502 for the caller, an error for the operator:
    ``gateway.upstream.attempt.key_refused``), not the replica's health, and no other replica
    will take it either."""
    return AttemptFailed(
        "rejected_key", f"{replica} answered {status}: the backend's API key was refused", False
    )


def _lean(
    wire: Http1Pool,
    replica: Replica,
    req: UpstreamRequest,
    timeouts: TimeoutConfig,
    first_byte_s: float,
) -> Awaitable[Http1Response]:
    """The request through the lean client, which keeps the time limits itself (no timer)."""
    return wire.post(
        _target(replica.base_url, req.path),
        req.body,
        req.headers.items(),
        connect_s=timeouts.connect_s,
        first_byte_s=first_byte_s,
        idle_s=timeouts.idle_s,
    )
