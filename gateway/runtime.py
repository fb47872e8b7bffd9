"""Everything a policy builds, swapped as one reference: tenants, surfaces, models and pools,
and the resources the policy decides (the embedder, the cache, the tier router, telemetry).

A ``Runtime`` is immutable once built (``gateway.build``); it answers the questions the stages
ask: who is calling, which surface, which destinations serve a model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.conversations import ResponseStore, open_store
from gateway.errors import NotFound, Unauthorized
from gateway.limits.config import LimitRules, price_of
from gateway.limits.cost import Price
from gateway.limits.limiter import Limiter
from gateway.limits.memory import MemoryStore
from gateway.observability.tracing import Telemetry
from gateway.protocol.openai import Endpoint
from gateway.upstream.providers import Provider, build_provider
from policies import models as policy_models
from policies.backends import AnthropicBackend, TimeoutConfig
from policies.loader import PolicySource
from policies.models import ModelTarget, TieredModelConfig
from policies.schema import Policy
from policies.surfaces import Budget, Priority, Surface, SurfaceActions
from routing.hedging import HedgePolicy
from routing.latency import ReplicaLatency
from routing.pool import BackendPool, ReplicaStates

if TYPE_CHECKING:
    from gateway.call import Embedder
    from gateway.stages.cache import CacheLedger, CacheStage
    from gateway.stages.tiers import TierStage
    from policies.cache import CachePolicy

log = logging.getLogger("llm_gateway")


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one attempt goes: a backend's pool and the model name sent to it."""

    pool: BackendPool
    upstream_model: str
    timeouts: TimeoutConfig
    provider: Provider | None = None  # None: the backend speaks OpenAI's API itself
    price: Price | None = None  # None: not priced (costs nothing against budgets)


@dataclass(frozen=True, slots=True)
class SurfacePlan:
    """What a surface asks of a request: its budget, its priority and the actions to take."""

    name: str
    budget: Budget
    priority: Priority
    actions: SurfaceActions
    hedge: HedgePolicy | None  # None when hedging is off for the surface
    cache: CachePolicy | None = None

    @classmethod
    def build(cls, name: str, surface: Surface, latency: ReplicaLatency) -> SurfacePlan:
        hedge = surface.actions.hedge
        policy = HedgePolicy(hedge, latency) if hedge.enabled else None
        return cls(name, surface.budget, surface.priority, surface.actions, policy, surface.cache)


_MALFORMED_KEY = re.compile(r"\s|[\x00-\x1f\x7f]")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Resources:
    embedder: Embedder | None
    cache: CacheStage | None
    telemetry: Telemetry
    owns_telemetry: bool  # False: a caller's (tests), never shut down here
    # Stored Responses API responses (in memory, or in the shared Redis).
    responses: ResponseStore = field(default_factory=lambda: open_store(None))
    # Tenant limits, budgets and usage (in memory, or shared in Redis).
    limiter: Limiter = field(default_factory=lambda: Limiter(MemoryStore()))
    # What the cache learned and counted: the running stage's, or, while a reload has turned
    # the cache off, the last stage's (the next stage goes on from it: counters never go back).
    cache_ledger: CacheLedger | None = None


class Runtime:
    def __init__(
        self,
        policy: Policy,
        source: PolicySource,
        pools: Mapping[str, BackendPool],
        resources: Resources,
        tiers: TierStage | None = None,
        latency: ReplicaLatency | None = None,
        *,
        replica_states: ReplicaStates | None = None,
    ) -> None:
        self.policy = policy
        self.source = source
        self.pools = dict(pools)
        self.embedder = resources.embedder
        self.cache = resources.cache
        self.responses = resources.responses
        self.telemetry = resources.telemetry
        self.limiter = resources.limiter
        self.limits = LimitRules(policy)
        self.resources = resources
        self.tiers = tiers
        self.latency = latency if latency is not None else ReplicaLatency()
        # Per backend and replica URL, what its pools share across reloads (in-flight counts,
        # lean connections): handed to the next runtime.
        self.replica_states = replica_states if replica_states is not None else ReplicaStates()
        self.providers: dict[str, Provider] = {}
        for name, backend in policy.backends.items():
            provider = build_provider(name, backend)
            if provider is not None:
                self.providers[name] = provider
        self._prices: dict[policy_models.Price, Price | None] = {}
        self._cache_models: dict[str, str] = {}  # alias -> its cache scope's model
        self.max_body_bytes = policy.server.max_body_bytes
        self.surface_header = policy.server.surface_header
        self.retry_after = str(policy.server.retry_after_s)
        token_env = policy.server.admin_token_env
        self.admin_token = os.environ.get(token_env) if token_env else None
        token_env = policy.server.metrics_token_env
        self.metrics_token = os.environ.get(token_env) if token_env else None
        self._tenants_by_digest: dict[str, str] = {}
        for name, tenant in policy.tenants.items():
            for key in tenant.api_keys:
                self._tenants_by_digest[key_digest(key)] = name
            for digest in tenant.api_key_sha256:
                self._tenants_by_digest[digest] = name
        self._surface_by_header: dict[str, SurfacePlan] = {}
        self._surface_by_tenant: dict[str, SurfacePlan] = {}
        default = policy.surfaces.get("default")
        self._default_surface = (
            SurfacePlan.build("default", default, self.latency) if default else _DEFAULT_SURFACE
        )
        for sname, surface in policy.surfaces.items():
            choice = SurfacePlan.build(sname, surface, self.latency)
            if surface.match.header is not None:
                self._surface_by_header[surface.match.header] = choice
            for tenant_name in surface.match.tenants:
                self._surface_by_tenant.setdefault(tenant_name, choice)

    # --- who -----------------------------------------------------------------------------
    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The tenant whose key the request carries: ``Authorization: Bearer <key>``, or
        ``x-api-key: <key>`` as Anthropic's clients send it."""
        if not self._tenants_by_digest:
            return "anonymous"
        authorization = headers.get("Authorization")
        if not authorization and headers.get("x-api-key"):
            authorization = "Bearer " + headers["x-api-key"]
        if not authorization:
            raise Unauthorized(
                "missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                code="invalid_api_key",
            )
        scheme, _, key = authorization.partition(" ")
        tenant = None
        # Exactly "Bearer <key>": a key padded with spaces, or holding bytes that are not
        # UTF-8 (aiohttp hands them over as surrogate escapes), is not a key anyone was given.
        if scheme.lower() == "bearer" and key and not _MALFORMED_KEY.search(key):
            try:
                tenant = self._tenants_by_digest.get(key_digest(key))
            except UnicodeEncodeError:
                tenant = None
        if tenant is None:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        return tenant

    # --- which surface -------------------------------------------------------------------
    def surface_for(self, tenant: str, header_value: str | None) -> SurfacePlan:
        if header_value is not None:
            choice = self._surface_by_header.get(header_value)
            if choice is not None:
                return choice
        return self._surface_by_tenant.get(tenant, self._default_surface)

    # --- which model ---------------------------------------------------------------------
    def targets(self, alias: str, endpoint: Endpoint = Endpoint.CHAT) -> list[Destination]:
        """The primary target and its fallbacks, in the order they are tried (for a passthrough
        endpoint, only those whose backend serves it itself)."""
        return self.serving(self._targets(alias), endpoint)

    def serving(self, targets: list[Destination], endpoint: Endpoint) -> list[Destination]:
        """Those of ``targets`` that can take a request of ``endpoint``: every one for a chat
        request (a translated Responses or Messages request is one) and the other OpenAI
        endpoints; for a passthrough (the client's own Responses or Messages request), only
        those whose backend serves that API itself. The one rule for every way to a backend:
        an alias's targets, a passthrough's choice, a spent budget's downgrade."""
        if endpoint not in (Endpoint.RESPONSES, Endpoint.MESSAGES):
            return targets
        return [t for t in targets if self.native(t, endpoint)]

    def passthrough(self, alias: str, endpoint: Endpoint) -> bool:
        """Whether a Responses or Messages request for ``alias`` is relayed untranslated: its
        primary backend serves the API itself (never a tiered alias: tiers are chosen on chat
        requests)."""
        return self.tiered(alias) is None and bool(self.serving(self._targets(alias)[:1], endpoint))

    def native(self, target: Destination, endpoint: Endpoint) -> bool:
        """Whether ``target``'s backend serves ``endpoint`` itself, relayed untranslated."""
        backend = self.policy.backends[target.pool.name]
        if endpoint is Endpoint.MESSAGES:
            return isinstance(backend, AnthropicBackend)
        if endpoint is Endpoint.RESPONSES:
            return getattr(backend, "responses", "translate") == "passthrough"
        return True

    def _targets(self, alias: str) -> list[Destination]:
        route = self.policy.models.get(alias)
        if isinstance(route, TieredModelConfig):
            return self.tier_targets(alias, route.small)
        if route is not None:
            primary = self.pools[route.backend]
            upstream = route.model or _default_upstream(alias, primary)
            targets = [self._target(primary, upstream, route.price)]
            for fb in route.fallbacks:
                pool = self.pools[fb.backend]
                upstream = fb.model or _default_upstream(alias, pool)
                targets.append(self._target(pool, upstream, fb.price or route.price))
            return targets
        for pool in self.pools.values():
            if alias in pool.models:
                return [self._target(pool, alias)]
        raise NotFound(f"The model '{alias}' does not exist", code="model_not_found")

    def cache_model(self, alias: str) -> str:
        """The model part of a cache scope: the alias and what it resolves to now (the primary
        target's backend and upstream model, or each tier's), so that a reload repointing the
        alias never serves the old model's cached answers."""
        resolved = self._cache_models.get(alias)
        if resolved is None:
            route = self.policy.models.get(alias)
            try:
                if isinstance(route, TieredModelConfig):
                    targets = [t for tier in route.tiers for t in self.tier_targets(alias, tier)]
                else:
                    targets = self._targets(alias)[:1]
            except NotFound:
                return alias
            names = ",".join(f"{t.pool.name}/{t.upstream_model}" for t in targets)
            resolved = self._cache_models[alias] = f"{alias}={names}"
        return resolved

    def tiered(self, alias: str) -> TieredModelConfig | None:
        entry = self.policy.models.get(alias)
        return entry if isinstance(entry, TieredModelConfig) else None

    def tier_targets(self, alias: str, tier: ModelTarget) -> list[Destination]:
        pool = self.pools[tier.backend]
        entry = self.policy.models.get(alias)
        price = tier.price or (entry.price if entry is not None else None)
        return [self._target(pool, tier.model or _default_upstream(alias, pool), price)]

    def _target(
        self, pool: BackendPool, upstream_model: str, price: policy_models.Price | None = None
    ) -> Destination:
        timeouts = self.policy.backends[pool.name].timeouts
        priced = self._prices.get(price) if price is not None else None
        if price is not None and priced is None:
            priced = self._prices[price] = price_of(price)
        return Destination(pool, upstream_model, timeouts, self.providers.get(pool.name), priced)

    def model_names(self) -> list[str]:
        names = list(self.policy.models)
        for pool in self.pools.values():
            names.extend(m for m in pool.models if m not in names)
        return names

    def not_ready(self) -> list[str]:
        return [name for name, pool in self.pools.items() if not pool.has_healthy()]


_DEFAULT_SURFACE = SurfacePlan("default", Budget(), "standard", SurfaceActions(), None)


def _default_upstream(alias: str, pool: BackendPool) -> str:
    """An alias with no ``model`` keeps its name, unless the pool serves other names only."""
    if pool.models and alias not in pool.models:
        return pool.models[0]
    return alias
