from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from policies.routing import (
    LeastLoadedRouting,
    PrecisePrefixRouting,
    PrefixRouting,
    RoutingConfig,
    default_routing,
)
from routing.factory import BackgroundRouter, MetricsObserver, RoutingSetupError, build_router
from routing.least_loaded import LeastLoadedRouter, RoundRobinRouter
from routing.prefix import ApproximatePrefixRouter, PrecisePrefixRouter
from routing.session import SessionRouter
from routing.sglang_cache_aware import SGLangCacheAwareRouter

ADAPTER: TypeAdapter[RoutingConfig] = TypeAdapter(RoutingConfig)


def test_missing_strategy_means_least_loaded() -> None:
    assert isinstance(ADAPTER.validate_python({}), LeastLoadedRouting)
    assert default_routing() == LeastLoadedRouting()


def test_documented_defaults() -> None:
    p = ADAPTER.validate_python({"strategy": "prefix"})
    assert isinstance(p, PrefixRouting)
    assert (p.chunk_chars, p.load_epsilon, p.load_slack, p.load_smoothing_s) == (64, 0.25, 1, 30)
    assert (p.max_waiting, p.max_kv_usage, p.min_match, p.kv_capacity_tokens) == (
        0,
        0.95,
        1,
        262_144,
    )
    s = ADAPTER.validate_python({"strategy": "sglang_cache_aware"})
    assert s.model_dump() == {
        "strategy": "sglang_cache_aware",
        "scrape_interval_s": 1.0,
        "scrape_timeout_s": 0.5,
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "eviction_interval_secs": 120.0,
        "max_tree_size": 2**26,
    }


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"strategy": "fastest"}, "strategy must be one of"),
        ({"strategy": "prefix", "chunk": 10}, "chunk"),
        ({"strategy": "prefix", "chunk_chars": 4}, "chunk_chars"),
        ({"strategy": "prefix", "max_kv_usage": 1.5}, "max_kv_usage"),
        ({"strategy": "session", "virtual_nodes": 0}, "virtual_nodes"),
        ({"strategy": "round_robin", "scrape_interval_s": 0.2}, "scrape_timeout_s"),
        ({"strategy": "prefix_precise", "tokenizer": "/no/such/tokenizer.json"}, "tokenizer"),
        ({"strategy": "prefix_precise", "kv_events": {"endpoints": {"a": {"endpoint": "x"}}}},
         "endpoint"),
    ],
)  # fmt: skip
def test_invalid_settings_are_rejected(raw: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as info:
        ADAPTER.validate_python(raw)
    assert where in str(info.value)


def test_models_are_frozen() -> None:
    p = PrefixRouting()
    with pytest.raises(ValidationError):
        p.chunk_chars = 10  # type: ignore[misc]


def test_factory_builds_each_strategy() -> None:
    def build(raw: dict[str, object]) -> object:
        return build_router(ADAPTER.validate_python(raw))

    assert isinstance(build_router(None), LeastLoadedRouter)
    assert isinstance(build({"strategy": "round_robin"}), RoundRobinRouter)
    assert isinstance(build({"strategy": "least_loaded"}), LeastLoadedRouter)
    assert isinstance(build({"strategy": "session"}), SessionRouter)
    assert isinstance(build({"strategy": "sglang_cache_aware"}), SGLangCacheAwareRouter)
    prefix = build({"strategy": "prefix"})
    assert isinstance(prefix, ApproximatePrefixRouter)
    assert isinstance(prefix, MetricsObserver)
    assert not isinstance(prefix, BackgroundRouter)
    precise = build({"strategy": "prefix_precise", "tokenizer": "bench.sim.tokenizer:tokenize"})
    assert isinstance(precise, PrecisePrefixRouter)
    assert isinstance(precise, BackgroundRouter)


def test_precise_needs_a_tokenizer() -> None:
    with pytest.raises(RoutingSetupError, match="tokenizer"):
        build_router(PrecisePrefixRouting())


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    router = build_router(PrecisePrefixRouting(tokenizer=str(path)))
    assert isinstance(router, PrecisePrefixRouter)
    assert router.blocks.tokenizer.encode("hello world zz") == [1, 2, 0]


def test_event_endpoints_follow_config() -> None:
    from routing.replica import Replica

    cfg = ADAPTER.validate_python(
        {
            "strategy": "prefix_precise",
            "tokenizer": "bench.sim.tokenizer:tokenize",
            "kv_events": {
                "port": 6000,
                "replay_port": None,
                "endpoints": {"10.0.0.2:8000": {"endpoint": "tcp://10.0.0.2:7000"}},
            },
        }
    )
    router = build_router(cfg)
    assert isinstance(router, PrecisePrefixRouter)
    replicas = [Replica("b", "http://10.0.0.1:8000/v1"), Replica("b", "http://10.0.0.2:8000/v1")]
    sources = router._sources(replicas)
    assert [(s.endpoint, s.replay_endpoint) for s in sources] == [
        ("tcp://10.0.0.1:6000", None),
        ("tcp://10.0.0.2:7000", None),
    ]
