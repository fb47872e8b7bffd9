"""A backend's pool of replicas: health checks, model discovery, and the router that chooses.

The pool owns the HTTP session its checks and scrapes go through, and its requests unless the
pool has the gateway's lean client (``routing.http1``: a vLLM backend's ``http://`` replicas,
one connection pool each), with at most ``max_connections`` open connections per replica. A pool a
reload drops is stopped at once but its session closes only when its last request has ended
(or after ``drain_s``), so answers in flight are not cut.

Across a reload the bounds per replica hold for the replica, not per pool: a new pool shares,
by replica URL, the in-flight counts of the pools it replaces (``share_in_flight``: routing and
admission's ``max_outstanding_per_replica`` count the requests still draining there) and, once
the reload is accepted, their lean connections (``take_over``: one ``Http1Pool`` per replica,
under the newest ``max_connections``) and the backend's admission queue.

Active checks (``GET /health`` on vLLM replicas) run every ``health.interval_s`` and decide
health on their own: a failed check takes a replica out, a passing one brings it back. Passive
ejection (consecutive connect errors or 5xx from proxied requests) is recorded on the
``Replica``. Model discovery asks ``GET /v1/models`` so a pool can expose what it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from policies.routing import RoutingConfig
from routing.admission import AdmissionQueue
from routing.factory import BackgroundRouter, MetricsObserver
from routing.http1 import Http1Pool
from routing.metrics_scrape import MetricsListener, MetricsScraper
from routing.replica import Replica
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

    def share_in_flight(self, previous: Iterable[BackendPool]) -> None:
        """Count requests in flight with ``previous`` pools' replicas of the same URL."""
        counts = {r.base_url: r.in_flight for pool in previous for r in pool.replicas}
        for replica in self.replicas:
            shared = counts.get(replica.base_url)
            if shared is not None:
                replica.in_flight = shared

    def take_over(self, previous: Iterable[BackendPool], replaced: BackendPool | None) -> None:
        """The reload is accepted: send through the previous pools' open lean connections
        (one connection pool per replica, under this pool's ``max_connections``), and admit
        through the queue of ``replaced`` (the same backend's pool), which goes on counting
        the tickets it granted and its waiters."""
        open_wires = {url: w for pool in previous for url, w in pool._wires.items() if w.open}
        for url, mine in list(self._wires.items()):
            theirs = open_wires.get(url)
            if theirs is None:
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
        if self.settings.discover_models:
            await self._discover()

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
