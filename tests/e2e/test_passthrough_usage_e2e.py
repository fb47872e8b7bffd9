"""Usage and cost of the routes relayed untranslated: Anthropic's Messages API to a
``kind: anthropic`` backend, the Responses API to a backend that serves it itself. Budgets and
token limits must not be bypassed by them (their usage has other shapes, their streams other
events)."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm
from tests.e2e.anthropic_fake import API_KEY, FakeAnthropic, start_fake_anthropic
from tests.e2e.limits_helpers import KEYS, PRICE, client, metric, settled, tenants
from tests.gateway.limits.conftest import Clock

RULES = {"limits": {"tokens_per_minute": 100_000}}


async def test_messages_passthrough_is_metered_on_anthropics_usage(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", API_KEY)
    fake = FakeAnthropic()
    runner, url = await start_fake_anthropic(fake)
    policy = build_policy(
        {"claude": {"kind": "anthropic", "base_url": url, "api_key_env": "TEST_ANTHROPIC_KEY"}},
        {"c": {"backend": "claude", "model": "claude-test-1", "price": PRICE}},
        tenants=tenants(**{"team-a": RULES}),
    )
    claude = anthropic.AsyncAnthropic(
        base_url="http://x", api_key=KEYS["team-a"], max_retries=0, timeout=20
    )
    try:
        gw = await make_gateway(policy, clock=Clock())
        claude = claude.with_options(base_url=gw.root)
        raw = await claude.messages.with_raw_response.create(
            model="c", max_tokens=64, messages=[{"role": "user", "content": "Hello"}]
        )
        assert fake.requests[-1].body["model"] == "claude-test-1"  # relayed as it is
        # 11 fresh input tokens, 2 read from Anthropic's cache, 7 out:
        # 11 x 1000 + 2 x 250 + 7 x 2000 per Mtok
        assert raw.headers["x-gateway-cost-usd"] == "0.0255"
        assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
        async with claude.messages.stream(
            model="c", max_tokens=64, messages=[{"role": "user", "content": "Hello"}]
        ) as stream:
            await stream.get_final_message()
        await settled(gw)
        g = [gw]
        assert await metric(g, "llm_gateway_tokens_total", kind="input") == 2 * 13
        assert await metric(g, "llm_gateway_tokens_total", kind="cached_input") == 2 * 2
        assert await metric(g, "llm_gateway_tokens_total", kind="output") == 2 * 7
        assert await metric(g, "llm_gateway_cost_usd_total") == pytest.approx(2 * 0.0255)
        assert fake.problems == []
    finally:
        await claude.close()
        await runner.cleanup()


async def test_responses_passthrough_is_metered_on_its_usage(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply="straight from upstream")
    policy = build_policy(
        {"up": vllm(up.url, responses="passthrough")},
        {"m": {"backend": "up", "model": "fake-model", "price": PRICE}},
        tenants=tenants(**{"team-a": RULES}),
    )
    gw = await make_gateway(policy, clock=Clock())
    c = client(gw)
    try:
        raw = await c.responses.with_raw_response.create(model="m", input="Hi")
        assert up.fake.requests[-1].path == "/v1/responses"
        assert raw.headers["x-gateway-cost-usd"] == "0.011"  # 5 x 1000 + 3 x 2000 per Mtok
        async with c.responses.stream(model="m", input="Hi") as stream:
            await stream.get_final_response()
        await settled(gw)
        assert await metric([gw], "llm_gateway_tokens_total", kind="output") == 2 * 3
        assert await metric([gw], "llm_gateway_cost_usd_total") == pytest.approx(0.022)
    finally:
        await c.close()
