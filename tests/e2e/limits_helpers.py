"""Building blocks of the limits tests: tenants with keys, a priced policy, calls, metrics."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningGateway, build_policy, vllm

KEYS = {"team-a": "sk-team-a-0001", "team-b": "sk-team-b-0002"}
# 5 prompt and 6 completion tokens (the fake's usage): 5 x 1000 + 6 x 2000 per Mtok = 0.017 USD
PRICE = {"input_per_mtok": 1000, "output_per_mtok": 2000, "cached_input_per_mtok": 250}
# What a budget holds for a request of MESSAGES with max_tokens 6 at PRICE until it settles:
# its prompt estimate (7 tokens) and 6 output tokens, 7 x 1000 + 6 x 2000 per Mtok. Without
# max_tokens it would hold 256 expected output tokens (over 0.5 USD).
HELD = 0.019
CHEAP = {"input_per_mtok": 10, "output_per_mtok": 20}
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]


def tenants(**rules: dict[str, Any]) -> dict[str, Any]:
    """Both tenants, keyed by digest; ``rules``: a tenant's ``limits`` / ``budget``."""
    return {
        name: {"api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()], **rules.get(name, {})}
        for name, key in KEYS.items()
    }


def limits_policy(
    url: str,
    redis_url: str | None,
    team_a: dict[str, Any],
    *,
    models: dict[str, Any] | None = None,
    surfaces: dict[str, Any] | None = None,
    failure_mode: str = "open",
    backends: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    team_b: dict[str, Any] | None = None,
) -> str:
    sections: dict[str, Any] = {
        "tenants": tenants(**{"team-a": team_a, "team-b": team_b or {}}),
        # A check slower than timeout_ms counts as Redis unavailable and is admitted (fail
        # open): these tests are about exactness, so a machine busy starting the vLLM tier
        # must not look like an outage (one CI run saw a 500 ms check time out).
        "shared_state": {
            "redis_url": redis_url or "",
            "limits_failure_mode": failure_mode,
            "timeout_ms": 5000,
        },
    }
    if surfaces:
        sections["surfaces"] = surfaces
    if server:
        sections["server"] = server
    return build_policy(
        backends or {"up": vllm(url)},
        models or {"m": {"backend": "up", "model": "fake-model", "price": PRICE}},
        **sections,
    )


def downgrade_policy(big_url: str, small_url: str, surfaces: dict[str, Any] | None = None) -> str:
    """Team A's budget (0.02 USD) covers one answer of "m" (backend "big") with max_tokens 6
    (``HELD``); after it (0.017) "m" is served by "lite" (backend "small", cheaper)."""
    backends = {"big": {"kind": "openai", "base_url": big_url},
                "small": {"kind": "openai", "base_url": small_url}}  # fmt: skip
    models = {"m": {"backend": "big", "price": PRICE}, "lite": {"backend": "small", "price": CHEAP}}
    budget = {"usd": 0.02, "on_exhausted": "downgrade", "downgrade_to": "lite"}
    return limits_policy(
        big_url, None, {"budget": budget}, models=models, backends=backends, surfaces=surfaces
    )


def client(gw: RunningGateway, tenant: str = "team-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEYS[tenant], max_retries=0, timeout=20)


async def chat(c: openai.AsyncOpenAI, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
    """Status, headers and body of one chat completion (errors included, never raised)."""
    kwargs.setdefault("model", "m")
    kwargs.setdefault("messages", MESSAGES)
    try:
        raw = await c.chat.completions.with_raw_response.create(**kwargs)
    except openai.APIStatusError as exc:
        return exc.status_code, dict(exc.response.headers), exc.body
    return raw.http_response.status_code, dict(raw.headers), raw.parse()


async def settled(*gateways: RunningGateway) -> None:
    """Every settlement in the background has reached the limit store."""
    for gw in gateways:
        await gw.runtime.limiter.drain()


async def metric(gateways: list[RunningGateway], name: str, **labels: str) -> float:
    """The sum over ``gateways`` of the samples of ``name`` matching ``labels``."""
    total = 0.0
    async with aiohttp.ClientSession() as session:
        for gw in gateways:
            async with session.get(gw.root + "/metrics") as resp:
                text = await resp.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name and all(
                        sample.labels.get(k) == v for k, v in labels.items()
                    ):
                        total += sample.value
    return total


async def usage_report(gw: RunningGateway, **query: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(gw.root + "/admin/usage", params=query) as resp,
    ):
        return resp.status, await resp.json()


async def spread(clients: list[openai.AsyncOpenAI], count: int, **kwargs: Any) -> list[int]:
    """``count`` concurrent chat completions, round-robin over ``clients``: their statuses."""
    results = await asyncio.gather(
        *(chat(clients[i % len(clients)], **kwargs) for i in range(count))
    )
    return [status for status, _, _ in results]
