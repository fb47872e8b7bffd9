"""Prefix-aware routing through the gateway, on two real vLLM CPU replicas.

Seven tenants, each with its own long system prompt (several 128-token KV blocks), ask three
short questions each, round by round. Round-robin over two replicas sends a tenant's second
question to the other replica (seven is odd), so each prefix is computed twice; the prefix
router keeps each tenant on one replica. Each arm uses fresh system prompts, so the arms do not
share cached blocks. Evidence comes from the replicas' own counters, not client timings.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest

from deploy.local.localpool import LocalVllmPool
from tests.conftest import GatewayFactory, build_policy, vllm

pytestmark = pytest.mark.vllm

TENANTS = 7
ROUNDS = 3
WORDS = [
    "replica",
    "cache",
    "prefix",
    "tenant",
    "policy",
    "budget",
    "stream",
    "token",
    "latency",
    "gateway",
    "router",
    "schedule",
    "batch",
    "decode",
    "prefill",
    "block",
    "memory",
    "queue",
    "metric",
    "health",
    "window",
]


def system_prompt(arm: str, tenant: int) -> str:
    words = [WORDS[(tenant * 7 + i * 3 + len(arm)) % len(WORDS)] for i in range(450)]
    return f"{arm} tenant {tenant} instructions: " + " ".join(words)


async def totals(pool: LocalVllmPool) -> dict[str, float]:
    names = (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_prefill_time_seconds_count",
    )
    out = dict.fromkeys(names, 0.0)
    async with aiohttp.ClientSession() as s:
        for url in pool.replicas:
            async with s.get(url.removesuffix("/v1") + "/metrics") as r:
                text = await r.text()
            for name in names:
                for m in re.finditer(
                    rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M
                ):
                    out[name] += float(m.group(1))
    return out


def routing_settings(pool: LocalVllmPool, strategy: str) -> dict[str, Any]:
    if strategy != "prefix_precise":
        return {"strategy": strategy, "scrape_interval_s": 1.0}
    # KV events from each replica's ZMQ publisher; the engine's own tokenizer.
    endpoints = {
        r.base_url: {"endpoint": r.kv_events.publisher, "replay_endpoint": r.kv_events.replay}
        for r in pool.replica_info
        if r.kv_events is not None
    }
    assert len(endpoints) == pool.count, "the pool must publish KV events"
    # pending_ttl_s 0: a match can only come from blocks the replica reported, never from the
    # gateway's own record of where it sent a prefix.
    return {"strategy": strategy, "tokenizer": str(pool.model_dir), "pending_ttl_s": 0,
            "kv_events": {"endpoints": endpoints}}  # fmt: skip


async def run_arm(
    pool: LocalVllmPool, make_gateway: GatewayFactory, strategy: str, label: str = ""
) -> dict[str, Any]:
    """``label`` names the arm's prompts (default: the strategy): arms never share a prefix."""
    routing = routing_settings(pool, strategy)
    backend = vllm(*pool.replicas, health={"interval_s": 5}, routing=routing)
    models = {"default": {"backend": "local"}}
    server = {"route_detail_headers": True}  # x-gateway-prefix-match, read below
    gw = await make_gateway(build_policy({"local": backend}, models, server=server))
    if strategy == "prefix_precise":
        await asyncio.sleep(1.0)  # ZMQ subscriptions join after connect (slow joiner)
    before = await totals(pool)
    placement: dict[int, set[str]] = {t: set() for t in range(TENANTS)}
    matched: list[int] = []
    for question in range(ROUNDS):
        for tenant in range(TENANTS):
            raw = await gw.client.chat.completions.with_raw_response.create(
                model="default",
                messages=[
                    {"role": "system", "content": system_prompt(label or strategy, tenant)},
                    {"role": "user", "content": f"question {question}?"},
                ],
                max_tokens=2,
                temperature=0,
            )
            placement[tenant].add(raw.headers["x-gateway-replica"])
            if question > 0:
                matched.append(int(raw.headers["x-gateway-prefix-match"]))
            if strategy == "prefix_precise" and question == 0:
                await asyncio.sleep(0.2)  # let the replica's BlockStored events arrive
    after = await totals(pool)
    delta = {k: after[k] - before[k] for k in before}
    return {
        "hits": delta["vllm:prefix_cache_hits_total"],
        "queries": delta["vllm:prefix_cache_queries_total"],
        "computed": delta["vllm:prefix_cache_queries_total"]
        - delta["vllm:prefix_cache_hits_total"],
        "ttft_mean": delta["vllm:time_to_first_token_seconds_sum"]
        / max(delta["vllm:time_to_first_token_seconds_count"], 1),
        "prefill_mean": delta["vllm:request_prefill_time_seconds_sum"]
        / max(delta["vllm:request_prefill_time_seconds_count"], 1),
        "replicas_per_tenant": max(len(v) for v in placement.values()),
        "min_match_warm": min(matched),
    }


async def test_prefix_routing_beats_round_robin_on_real_vllm(
    vllm_pool: LocalVllmPool, make_gateway: GatewayFactory
) -> None:
    rr = await run_arm(vllm_pool, make_gateway, "round_robin")
    prefix = await run_arm(vllm_pool, make_gateway, "prefix")
    print(f"round_robin {rr}\nprefix      {prefix}")
    assert rr["replicas_per_tenant"] == 2  # round-robin split every tenant
    assert prefix["replicas_per_tenant"] == 1  # prefix affinity kept each tenant on one
    assert prefix["queries"] > 0
    # Expected about 2x (14 warm requests of 21 against 7); demand a clear margin.
    assert prefix["hits"] >= 1.4 * rr["hits"]
    # Less prefill: the prompt tokens the engines computed rather than read from their cache.
    # (Counted, not timed: the prefill and TTFT means, printed above, flip now and then on two
    # shared cores, where one request delayed by another process outweighs the difference.)
    assert prefix["computed"] < 0.8 * rr["computed"]  # ~0.55x expected


async def test_precise_prefix_routing_on_real_vllm_kv_events(
    vllm_pool: LocalVllmPool, make_gateway: GatewayFactory
) -> None:
    """prefix_precise routes on the blocks the replicas announced over ZMQ, not on a guess."""
    rr = await run_arm(vllm_pool, make_gateway, "round_robin", "round_robin_vs_precise")
    precise = await run_arm(vllm_pool, make_gateway, "prefix_precise")
    print(f"round_robin    {rr}\nprefix_precise {precise}")
    assert precise["replicas_per_tenant"] == 1
    # Every warm request matched at least one full 128-token block that the replica itself
    # reported (the system prompts span several), so the index is fed by real events and our
    # tokenization and chat rendering agree with the engine's.
    assert precise["min_match_warm"] >= 128
    assert precise["hits"] >= 1.4 * rr["hits"]
    assert precise["computed"] < 0.8 * rr["computed"]
