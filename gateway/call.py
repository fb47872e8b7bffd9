"""One API request as the stages see it: who, what, which surface, and its clock.

``Call`` is built once, completely, by ``Orchestrator.accept`` and only read afterwards; what a
stage decides (a cache plan, a tier, an attempt) is that stage's return value, never a field
filled in here later. The one exception is ``leases``: every upstream attempt opened for the
request is listed there as it opens, and whatever is still open when the request ends (a
stage's bug: each attempt has an owner that finishes it) is released then, and logged. ``UserQuery`` holds the user's text (``gateway.protocol.openai``'s one
rule) and computes its embedding at most once, off the event loop, for the semantic cache and
the difficulty estimator alike.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from gateway.observability.tracing import RequestSpan
from gateway.protocol.body import read_body as read_bounded_body
from gateway.protocol.openai import ParsedRequest
from gateway.upstream.client import FORWARDED_HEADERS
from gateway.upstream.out import ClientDialect
from policies.server import ServerConfig
from routing.prompt_text import render_for_routing

# The request's id: the caller's x-request-id when it is sane, else a new one (middleware.py);
# it is on every response, the streamed ones included (set before the relay prepares them).
REQUEST_ID = web.RequestKey("llm_gateway.request_id", str)

if TYPE_CHECKING:
    from gateway.runtime import Runtime, SurfacePlan

log = logging.getLogger("llm_gateway.upstream")

# Keys under which the orchestrator leaves a request's metric labels and final status (read by
# the metrics middleware, and by the limits stage settling what the answer used).
LABELS_KEY = web.RequestKey("llm_gateway.labels", tuple[str, str, str])
STATUS_KEY = web.RequestKey("llm_gateway.status", int)


class Dialect(ClientDialect, Protocol):
    """A request in another client API (``gateway.dialects``): the request the stages run, and
    how its answer goes back (``ClientDialect``, what the relay needs)."""

    @property
    def parsed(self) -> ParsedRequest: ...

    @property
    def answer_id(self) -> str | None:
        """The id of the answer its client gets, when the dialect gives it its own (a
        re-told answer); None when the upstream's is passed on."""
        ...


class Embedder(Protocol):
    async def embed(self, texts: list[str]) -> Any: ...


@dataclass(slots=True)
class UserQuery:
    """The user's text and its one embedding: ``start`` sets it computing (the cache stage does,
    so that it runs while the exact key is read); every ``vector`` call awaits that one task."""

    embedder: Embedder | None
    text: str | None
    _task: asyncio.Future[Any] | None = None

    def start(self) -> None:
        if self._task is None and self.embedder is not None and self.text:
            self._task = asyncio.ensure_future(self.embedder.embed([self.text]))
            # An exact hit may never await it: its outcome is still retrieved, never logged.
            self._task.add_done_callback(_retrieve)

    async def vector(self) -> Any:
        self.start()
        if self._task is None:
            return None
        # Shielded: a caller that times out leaves the embedding to the others.
        return (await asyncio.shield(self._task))[0]


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class Lease(Protocol):
    """What the request holds while an upstream attempt is open: the replica's load, the
    connection, the attempt's span (``gateway.upstream.attempt.Attempt``)."""

    def abandon(self) -> str | None:
        """Release what is still held and say where (``backend/replica``); None when the
        attempt's owner had finished it (the usual case)."""
        ...


class Leases:
    """The attempts opened for one request; ``with call.leases:`` around the request's stages
    releases any left open when they end, however they end (an answer, an error, the client
    gone). Each release is a gateway bug made harmless: it is logged at ERROR, with the
    request's id, so it gets fixed, while the replica's load count stays right."""

    __slots__ = ("held", "request_id")

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self.held: list[Lease] = []

    def add(self, lease: Lease) -> None:
        self.held.append(lease)

    def __enter__(self) -> Leases:
        return self

    def __exit__(self, *exc_info: object) -> None:
        held, self.held = self.held, []
        for lease in held:
            where = lease.abandon()
            if where is not None:
                log.error(
                    "request %s ended with its attempt on %s still open: released",
                    self.request_id or "-",
                    where,
                )


@dataclass(slots=True)
class Call:
    request: web.Request
    rt: Runtime  # the policy in force when the request arrived, for its whole life
    tenant: str
    parsed: ParsedRequest
    plan: SurfacePlan
    span: RequestSpan
    started: float  # perf_counter at arrival
    deadline: float | None  # perf_counter by which the answer must be complete (the surface's)
    headers: CIMultiDict[str]  # forwarded upstream
    query: UserQuery
    session_key: str | None = None
    dialect: Dialect | None = None  # the client's API when it is not the upstream's (Responses...)
    # The gateway asked the upstream for the stream's usage the client did not ask for: the
    # usage chunk is taken out of what the client gets (gateway.protocol.usage).
    strip_usage: bool = False
    leases: Leases = field(default_factory=Leases)  # the attempts opened, released at the end
    # (backend, replica) of the last attempt begun: a request that fails with no answer is
    # labelled (metrics, access log) with it, as an answered one is with its answer's.
    tried: tuple[str, str] | None = None
    _prompt_text: str | None = field(default=None)

    def routing_text(self) -> str:
        """The prompt rendered as the replicas see it (for prefix-aware routers), once."""
        if self._prompt_text is None:
            self._prompt_text = render_for_routing(self.parsed.body)
        return self._prompt_text

    @property
    def include_usage(self) -> bool:
        """The client asked for the stream's usage chunk."""
        opts = self.parsed.body.get("stream_options")
        return isinstance(opts, dict) and bool(opts.get("include_usage")) and not self.strip_usage


def upstream_headers(request: web.Request) -> CIMultiDict[str]:
    """What travels upstream of the caller's headers (never its API key), each only when it is
    printable ASCII of at most 1 KiB; and the request's id, the gateway's (its logs and the
    replica's then name the same request), never the caller's raw header."""
    headers: CIMultiDict[str] = CIMultiDict(
        {"Content-Type": "application/json", "x-request-id": request[REQUEST_ID]}
    )
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is not None and len(value) <= 1024 and value.isascii() and value.isprintable():
            headers[name] = value
    return headers


async def read_body(request: web.Request, server: ServerConfig) -> bytes:
    """The request body, decoded and bounded by the policy's ``server`` settings (size on the
    wire and decoded, inflate ratio, time): see ``gateway.protocol.body``."""
    return await read_bounded_body(
        request, server.max_body_bytes, server.body_timeout_s, server.max_inflate_ratio
    )
