"""Build a router from a backend's validated routing settings (one line per strategy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from policies.routing import (
    BalancedRouting,
    LeastLoadedRouting,
    PrecisePrefixRouting,
    PrefixRouting,
    RoundRobinRouting,
    RoutingConfig,
    SessionRouting,
    SGLangCacheAwareRouting,
)
from routing.kv_events import KVEventSource, event_sources
from routing.kv_index import Tokenizer, load_tokenizer
from routing.least_loaded import LeastLoadedRouter, RoundRobinRouter
from routing.load import BalanceSettings
from routing.metrics_scrape import VllmMetrics
from routing.prefix import ApproximatePrefixRouter, PrecisePrefixRouter
from routing.replica import Replica
from routing.router import Router
from routing.session import SessionRouter
from routing.sglang_cache_aware import SGLangCacheAwareRouter


class RoutingSetupError(ValueError):
    """Settings that validate but cannot be built (a tokenizer that fails to load)."""


@runtime_checkable
class BackgroundRouter(Protocol):
    """A router with background work (KV-event subscriptions): start it in cleanup_ctx."""

    async def start(self, replicas: Sequence[Replica]) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class CarriedRouter(Protocol):
    """A router whose state outlives a reload: the new one starts from the replaced one's."""

    def carry_over(self, replaced: object, replicas: Sequence[Replica]) -> None: ...


@runtime_checkable
class MetricsObserver(Protocol):
    """A router that learns from scraped /metrics (pass it to MetricsScraper's listeners)."""

    def observe_metrics(self, replica: Replica, sample: VllmMetrics) -> None: ...


@runtime_checkable
class HealthObserver(Protocol):
    """A router whose knowledge of a replica dies with it (KV blocks): the pool says when the
    replica leaves service (a failed check, an ejection); it may come back restarted."""

    def replica_out(self, replica: Replica) -> None: ...


def balance_settings(config: BalancedRouting) -> BalanceSettings:
    return BalanceSettings(
        epsilon=config.load_epsilon,
        slack=config.load_slack,
        max_waiting=config.max_waiting,
        max_kv_usage=config.max_kv_usage,
    )


def _precise(config: PrecisePrefixRouting, tokenizer: Tokenizer | None) -> PrecisePrefixRouter:
    if tokenizer is None:
        if config.tokenizer is None:
            raise RoutingSetupError("strategy prefix_precise needs `tokenizer`")
        try:
            tokenizer = load_tokenizer(config.tokenizer)
        except Exception as exc:
            raise RoutingSetupError(f"tokenizer {config.tokenizer!r}: {exc}") from exc
    ev = config.kv_events
    overrides = {k: (v.endpoint, v.replay_endpoint) for k, v in ev.endpoints.items()}

    def sources(replicas: Sequence[Replica]) -> list[KVEventSource]:
        return event_sources(
            replicas,
            port=ev.port,
            replay_port=ev.replay_port,
            topic=ev.topic,
            endpoints=overrides,
        )

    return PrecisePrefixRouter(
        tokenizer,
        sources=sources,
        default_block_size=config.block_size,
        pending_ttl_s=config.pending_ttl_s,
        balance=balance_settings(config),
        min_match=config.min_match,
        replay_timeout_s=ev.replay_timeout_s,
        work_half_life_s=config.work_half_life_s,
        load_smoothing_s=config.load_smoothing_s,
        max_prefix_chars=config.max_prefix_chars,
    )


def build_router(config: RoutingConfig | None, *, tokenizer: Tokenizer | None = None) -> Router:
    """``tokenizer`` overrides the configured one of ``prefix_precise`` (tests, simulator)."""
    if config is None or isinstance(config, LeastLoadedRouting):
        return LeastLoadedRouter()
    if isinstance(config, RoundRobinRouting):
        return RoundRobinRouter()
    if isinstance(config, PrefixRouting):
        return ApproximatePrefixRouter(
            chunk_chars=config.chunk_chars,
            kv_capacity_tokens=config.kv_capacity_tokens,
            chars_per_token=config.chars_per_token,
            balance=balance_settings(config),
            min_match=config.min_match,
            learn_capacity=config.learn_capacity,
            work_half_life_s=config.work_half_life_s,
            load_smoothing_s=config.load_smoothing_s,
            max_prefix_chars=config.max_prefix_chars,
        )
    if isinstance(config, PrecisePrefixRouting):
        return _precise(config, tokenizer)
    if isinstance(config, SessionRouting):
        return SessionRouter(
            virtual_nodes=config.virtual_nodes,
            prefix_chars=config.prefix_chars,
            bounded_load_epsilon=config.bounded_load_epsilon,
        )
    if isinstance(config, SGLangCacheAwareRouting):
        return SGLangCacheAwareRouter(
            cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            eviction_interval_secs=config.eviction_interval_secs,
            max_tree_size=config.max_tree_size,
        )
    raise RoutingSetupError(f"unknown routing strategy {config!r}")
