"""Routing settings of one vLLM backend (``backends.<name>.routing`` in the policy file).

One frozen model per strategy, chosen by ``strategy``; unknown keys are errors. Every setting
has a default, so ``routing: {strategy: prefix}`` is a complete configuration. The algorithms
and the meaning of each setting are explained where they are implemented: routing/prefix.py,
routing/kv_index.py, routing/session.py, routing/sglang_cache_aware.py, routing/load.py.

``scrape_interval_s`` (every strategy): how often the pool reads each replica's vLLM
``/metrics`` for its queue and KV usage (routing/metrics_scrape.py); 0 turns scraping off.
Strategies that use load (least_loaded, prefix, prefix_precise, bounded session) then see the
gateway's own outstanding counts only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from policies.strict import Strict


class _RoutingBase(Strict):
    scrape_interval_s: float = Field(default=1.0, ge=0, le=60)
    scrape_timeout_s: float = Field(default=0.5, gt=0, le=30)

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> _RoutingBase:
        if self.scrape_interval_s and self.scrape_timeout_s > self.scrape_interval_s:
            raise ValueError("scrape_timeout_s must not exceed scrape_interval_s")
        return self


class BalancedRouting(_RoutingBase):
    """The bounded-load rule (routing/load.py) shared by the prefix strategies."""

    load_epsilon: float = Field(default=0.25, ge=0, le=10)
    load_slack: float = Field(default=1.0, ge=0)
    load_smoothing_s: float = Field(default=30.0, ge=0, le=600)
    max_waiting: int | None = Field(default=0, ge=0)
    max_kv_usage: float | None = Field(default=0.95, gt=0, le=1)
    min_match: int = Field(default=1, ge=1)
    work_half_life_s: float = Field(default=30.0, gt=0, le=3600)


class RoundRobinRouting(_RoutingBase):
    strategy: Literal["round_robin"] = "round_robin"


class LeastLoadedRouting(_RoutingBase):
    strategy: Literal["least_loaded"] = "least_loaded"


class PrefixRouting(BalancedRouting):
    strategy: Literal["prefix"] = "prefix"
    chunk_chars: int = Field(default=64, ge=16, le=65536)
    kv_capacity_tokens: int = Field(default=262_144, ge=1)
    chars_per_token: float = Field(default=4.0, gt=0, le=32)
    learn_capacity: bool = True  # take num_gpu_blocks x block_size from /metrics when present
    # Only the routing text's first characters are hashed (0.2 us per chunk, on the event loop).
    max_prefix_chars: int = Field(default=262_144, ge=1024, le=16 * 2**20)


class KVEventEndpoint(Strict):
    endpoint: str = Field(pattern=r"^(tcp|ipc|inproc)://")
    replay_endpoint: str | None = Field(default=None, pattern=r"^(tcp|ipc|inproc)://")


class KVEventsSettings(Strict):
    port: int = Field(default=5557, ge=1, le=65535)
    replay_port: int | None = Field(default=5558, ge=1, le=65535)
    topic: str = "kv"
    # Per replica (its host:port or base URL) when ports differ between replicas.
    endpoints: dict[str, KVEventEndpoint] = Field(default_factory=dict)
    replay_timeout_s: float = Field(default=1.0, gt=0, le=30)


class PrecisePrefixRouting(BalancedRouting):
    strategy: Literal["prefix_precise"] = "prefix_precise"
    # Path to the served model's tokenizer.json (or its directory), or "module:function".
    tokenizer: str | None = None
    block_size: int = Field(default=16, ge=1, le=4096)  # until the events report theirs
    pending_ttl_s: float = Field(default=2.0, ge=0, le=60)
    # Only the routing text's first characters are tokenized (~0.3 us each, on the event loop).
    max_prefix_chars: int = Field(default=65_536, ge=1024, le=16 * 2**20)
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings)

    @model_validator(mode="after")
    def _tokenizer_exists(self) -> PrecisePrefixRouting:
        t = self.tokenizer
        if t is not None and ":" not in t and not Path(t).exists():
            raise ValueError(f"tokenizer {t!r}: no such file or directory")
        return self


class SessionRouting(_RoutingBase):
    strategy: Literal["session"] = "session"
    virtual_nodes: int = Field(default=160, ge=1, le=10_000)
    prefix_chars: int = Field(default=256, ge=1)
    bounded_load_epsilon: float | None = Field(default=None, ge=0, le=10)


class SGLangCacheAwareRouting(_RoutingBase):
    strategy: Literal["sglang_cache_aware"] = "sglang_cache_aware"
    cache_threshold: float = Field(default=0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1)
    eviction_interval_secs: float = Field(default=120.0, ge=0)
    max_tree_size: int = Field(default=2**26, ge=1)


def _strategy_of(value: object) -> str:
    if isinstance(value, dict):
        strategy = value.get("strategy", DEFAULT_STRATEGY)
        return strategy if isinstance(strategy, str) else ""
    return str(getattr(value, "strategy", ""))


DEFAULT_STRATEGY = "least_loaded"

# A backend without ``routing`` (or with no ``strategy``) routes least_loaded.
RoutingConfig = Annotated[
    Annotated[RoundRobinRouting, Tag("round_robin")]
    | Annotated[LeastLoadedRouting, Tag("least_loaded")]
    | Annotated[PrefixRouting, Tag("prefix")]
    | Annotated[PrecisePrefixRouting, Tag("prefix_precise")]
    | Annotated[SessionRouting, Tag("session")]
    | Annotated[SGLangCacheAwareRouting, Tag("sglang_cache_aware")],
    Discriminator(
        _strategy_of,
        custom_error_type="unknown_strategy",
        custom_error_message=(
            "strategy must be one of: round_robin, least_loaded, prefix, prefix_precise, "
            "session, sglang_cache_aware"
        ),
    ),
]


def default_routing() -> LeastLoadedRouting:
    """The routing of a backend that names none (for ``Field(default_factory=...)``)."""
    return LeastLoadedRouting()


STRATEGIES = (
    "round_robin",
    "least_loaded",
    "prefix",
    "prefix_precise",
    "session",
    "sglang_cache_aware",
)
