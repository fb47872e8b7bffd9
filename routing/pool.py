"""A backend's pool of replicas: health checks, model discovery, and the router that chooses.

The pool owns the HTTP session its checks and scrapes go through, and its requests unless the
pool has the gateway's lean client (``routing.http1``: a vLLM backend's ``http://`` replicas,
one connection pool each), with at most ``max_connections`` open connections per replica. A pool a
reload drops is stopped at once but its session closes only when its last request has ended
(or after ``drain_s``), so answers in flight are not cut.

Across a reload the bounds per replica hold for the replica, not per pool: once the reload is
accepted (``take_over``), a backend's new pool shares, per replica URL, the in-flight count of
the backend's pools that still hold requests there (routing and admission's
``max_outstanding_per_replica`` count the requests still draining) and their lean connections
(one ``Http1Pool`` per backend and replica, under the newest ``max_connections``), and it takes
the backend's admission queue over. That state lives in ``ReplicaStates``, one per gateway, kept
across runtimes: it is found from any pool still draining, not only from the one replaced (a
URL removed by one reload and added back by the next), and it is the backend's own (two
backends naming one URL keep their own connections, limits and counts).

Active checks (``GET /health`` on vLLM replicas) run every ``health.interval_s`` and decide
health on their own: a failed check takes a replica out, a passing one brings it back. Passive
ejection (consecutive connect errors or 5xx from proxied requests) is recorded on the
``Replica``. Each round tells a ``HealthObserver`` router which replicas left service since
the last (a precise prefix router then forgets their KV blocks: they may come back restarted). Model discovery asks ``GET /v1/models`` so a pool can expose what it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from policies.routing import RoutingConfig
from routing.admission import AdmissionQueue
from routing.factory import BackgroundRouter, CarriedRouter, HealthObserver, MetricsObserver
from routing.http1 import Http1Pool
from routing.metrics_scrape import MetricsListener, MetricsScraper
from routing.replica import InFlight, Replica
from routing.router import Router

log = logging.getLogger("llm_gateway.pool")


@dataclass(frozen=True)
class PoolSettings:
    name: str
    kind: str  # "vllm" | "openai" | "anthropic"
    base_urls: tuple[str, ...]
    api_key: str | None
    active_health: bool
    health_interval_s: float
    health_timeout_s: float
    eject_after: int
    cooldown_s: float
    discover_models: bool
    max_connections: int = 1000  # per replica
    lean_http: bool = False  # requests to http:// replicas go through routing.http1


class ReplicaStates:
    """What a backend's pools share per replica URL across reloads, for as long as a pool (or
    a request in flight) holds it: the count of requests in flight and the lean connections.

    One per gateway, handed from runtime to runtime. Keyed by (backend, URL): each backend
    keeps its own, as it did before any reload. The entries are weak: one goes when the last
    pool and request holding it are gone, so reloads that keep changing URLs leave nothing
    behind; a connection pool closed by its last holder is no longer handed out.
    """

    def __init__(self) -> None:
        self._in_flight: weakref.WeakValueDictionary[tuple[str, str], InFlight]
        self._in_flight = weakref.WeakValueDictionary()
        self._wires: weakref.WeakValueDictionary[tuple[str, str], Http1Pool]
        self._wires = weakref.WeakValueDictionary()

    def in_flight(self, backend: str, url: str, mine: InFlight) -> InFlight:
        """The count of ``backend``'s requests in flight to ``url`` that a pool still holds,
        else ``mine`` (held from now on)."""
        held = self._in_flight.get((backend, url))
        if held is None:
            self._in_flight[(backend, url)] = held = mine
        return held

    def wire(self, backend: str, url: str, mine: Http1Pool) -> Http1Pool:
        """``backend``'s open lean connections to ``url``, else ``mine`` (held from now on)."""
        held = self._wires.get((backend, url))
        if held is None or not held.open:
            self._wires[(backend, url)] = held = mine
        return held

    def __len__(self) -> int:
        """Entries still held (counts and connection pools)."""
        return len(self._in_flight) + len(self._wires)


@dataclass(eq=False)
class BackendPool:
    settings: PoolSettings
    router: Router
    replicas: list[Replica] = field(default_factory=list)
    models: tuple[str, ...] = ()  # discovered, in the order the upstream listed them
    routing_config: RoutingConfig | None = None  # what the router was built from
    needs_prompt_text: bool = True  # False for routers that never look at the prompt
    admission: AdmissionQueue | None = None  # the gateway's priority queue in front of the pool
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None
    _wires: dict[str, Http1Pool] = field(default_factory=dict)  # base_url: lean client
    _wire_tokens: dict[str, object] = field(default_factory=dict)  # base_url: share token
    _scraper: MetricsScraper | None = None
    _router_running: bool = False
    _queue_until: int | None = None  # the admission queue went to a new pool at this epoch
    _out: set[str] = field(default_factory=set)  # base URLs the router was told are out

    def __post_init__(self) -> None:
        s = self.settings
        if not self.replicas:
            self.replicas = [
                Replica(
                    s.name,
                    url,
                    eject_after=s.eject_after,
                    cooldown_s=s.cooldown_s,
                    per_model=s.kind != "vllm",
                )
                for url in s.base_urls
            ]
        if s.active_health:
            for r in self.replicas:
                r.healthy = False  # unknown until the first check passes
                r.last_error = "not checked yet"

    @property
    def name(self) -> str:
        return self.settings.name

    def available(self, model: str | None = None) -> list[Replica]:
        """Replicas that take traffic (for ``model``, where health is kept per model)."""
        now = time.monotonic()
        return [r for r in self.replicas if r.available(now, model)]

    def has_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def auth_headers(self) -> dict[str, str]:
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def take_over(self, states: ReplicaStates, replaced: BackendPool | None) -> None:
        """The reload is accepted (or the first runtime built): count the requests in flight
        and send through the connections of this backend's pools that still hold them, per
        replica URL (``states``: the one replaced, or one draining from reloads before; the
        connections under this pool's ``max_connections``), and admit through the queue of
        ``replaced`` (the same backend's pool), which goes on counting the tickets it granted
        and its waiters. What this pool brings of its own is kept in ``states`` for the
        pools of later reloads. A router that can (``CarriedRouter``) starts from what
        ``replaced``'s router knew of the replicas both serve."""
        if replaced is not None and isinstance(self.router, CarriedRouter):
            self.router.carry_over(replaced.router, self.replicas)
        for replica in self.replicas:
            replica.in_flight = states.in_flight(self.name, replica.base_url, replica.in_flight)
        for url, mine in list(self._wires.items()):
            theirs = states.wire(self.name, url, mine)
            if theirs is mine:
                continue
            mine.unshare(self._wire_tokens[url])  # never used: no request came before the swap
            self._wires[url] = theirs
            self._wire_tokens[url] = theirs.share(self.settings.max_connections)
        if replaced is not None and replaced.admission is not None and self.admission is not None:
            replaced._queue_until = replaced.admission.follow(lambda: self.replicas)
            self.admission = replaced.admission

    def wire(self, replica: Replica) -> Http1Pool | None:
        """The lean client's connections to ``replica``; None: requests go through aiohttp."""
        return self._wires.get(replica.base_url)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"backend {self.name} is not started")
        return self._session

    async def start(self) -> None:
        """Open the session; first health round and model discovery, then the periodic loop."""
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.settings.max_connections, keepalive_timeout=30
        )
        # auto_decompress: public APIs and the CDNs in front of them compress answers; the relay
        # drops Content-Encoding, so what it passes on must be the decoded bytes (a stream is
        # decoded read by read). Uncompressed answers, vLLM's, cost nothing extra.
        session = aiohttp.ClientSession(connector=connector, auto_decompress=True, trust_env=False)
        self._session = session
        if self.settings.lean_http:
            for replica in self.replicas:
                url = URL(replica.base_url)
                if url.scheme == "http" and url.host is not None and url.port is not None:
                    wire = Http1Pool(url.host, url.port, self.settings.max_connections)
                    self._wires[replica.base_url] = wire
                    self._wire_tokens[replica.base_url] = wire.share(self.settings.max_connections)
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name=f"pool-{self.name}")
        cfg = self.routing_config
        if cfg is not None and cfg.scrape_interval_s > 0 and self.settings.kind == "vllm":
            listeners: list[MetricsListener] = []
            if isinstance(self.router, MetricsObserver):
                listeners.append(self.router.observe_metrics)
            if self.admission is not None:
                listeners.append(lambda _replica, _sample: self._recheck_admission())
            self._scraper = MetricsScraper(
                lambda: self.replicas,
                cfg.scrape_interval_s,
                cfg.scrape_timeout_s,
                listeners,
                session,
            )
            await self._scraper.start()
        if isinstance(self.router, BackgroundRouter):
            await self.router.start(self.replicas)
            self._router_running = True

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop the loops; close the session once no request is in flight (at most ``drain_s``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._scraper is not None:
            await self._scraper.stop()
            self._scraper = None
        if self._router_running and isinstance(self.router, BackgroundRouter):
            self._router_running = False
            await self.router.stop()
        waited = 0.0
        while waited < drain_s and self._busy():
            await asyncio.sleep(0.5)
            waited += 0.5
        for url, wire in self._wires.items():
            wire.unshare(self._wire_tokens[url])  # closed unless a new pool sends through it
        self._wires.clear()
        self._wire_tokens.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _recheck_admission(self) -> None:
        if self.admission is not None:  # the queue in force (a reload may hand it on)
            self.admission.recheck()

    def _busy(self) -> bool:
        """Requests sent through this pool, or admitted or queued by its admission queue (they
        are sent through it next), not yet done."""
        queue = self.admission
        if queue is not None:
            if self._queue_until is not None:  # the queue went on: what came before it
                if queue.held_before(self._queue_until):
                    return True
            elif queue.active or queue.waiting:
                return True
        return any(r.own for r in self.replicas)

    async def refresh(self) -> None:
        if self.settings.active_health:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
        self._tell_router_who_left()
        if self.settings.discover_models:
            await self._discover()

    def _tell_router_who_left(self) -> None:
        """Once per stay out of service (a failed check, or an ejection seen by this round)."""
        if not isinstance(self.router, HealthObserver):
            return
        for replica in self.replicas:
            if replica.healthy:
                self._out.discard(replica.base_url)
            elif replica.base_url not in self._out:
                self._out.add(replica.base_url)
                self.router.replica_out(replica)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop future checks
                log.exception("health round failed for backend %s", self.name)

    async def _check(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
        try:
            async with self.session.get(
                replica.root_url + "/health", timeout=timeout, headers=self.auth_headers()
            ) as resp:
                ok = resp.status == 200
                reason = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__}"
        except Exception as exc:  # a request aiohttp refuses to send: down, and why, not a crash
            ok, reason = False, f"/health cannot be sent: {type(exc).__name__}: {exc}"
        if ok:
            if not replica.healthy:
                log.info("replica %s of %s is healthy", replica.name, self.name)
            replica.record_success()
        elif replica.healthy or replica.last_error != reason:
            log.warning("replica %s of %s is down: %s", replica.name, self.name, reason)
            replica.mark_down(reason)

    async def _discover(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
        for replica in self.replicas:
            if not replica.healthy and self.settings.active_health:
                continue
            try:
                async with self.session.get(
                    replica.base_url + "/models", timeout=timeout, headers=self.auth_headers()
                ) as resp:
                    if resp.status != 200:
                        continue
                    payload = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            ids = _model_ids(payload)
            if ids:
                self.models = ids
                return


def _model_ids(payload: object) -> tuple[str, ...]:
    if not isinstance(payload, dict):
        return ()
    data = payload.get("data")
    if not isinstance(data, list):
        return ()
    ids = (m.get("id") for m in data if isinstance(m, dict))
    return tuple(i for i in ids if isinstance(i, str) and _sane_name(i))


def _sane_name(name: str) -> bool:
    """A model name fit to be a metric label and a header: printable, UTF-8, not huge."""
    if not 0 < len(name) <= 256 or not name.isprintable():
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from the upstream's JSON
        return False
    return True


def all_replicas(pools: Sequence[BackendPool]) -> list[Replica]:
    return [r for p in pools for r in p.replicas]
