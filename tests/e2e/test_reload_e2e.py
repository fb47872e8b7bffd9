"""Reloads rebuild what the policy decides, or refuse the new file with file:line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, vllm

MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]


async def reload(root: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(root + "/admin/reload") as r:
        return r.status, await r.text()


async def test_a_reload_that_adds_a_cache_takes_effect(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    up = await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(pool_policy([up.url]))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert gw.runtime.cache is None
    path.write_text(pool_policy([up.url], surfaces={"default": {"cache": {"exact": True}}}))
    status, text = await reload(gw.root)
    assert status == 200, text
    assert gw.runtime.cache is not None
    for _ in range(2):
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, temperature=0
        )
        await gw.runtime.cache.drain()
    assert raw.headers["x-gateway-cache"] == "exact"
    assert len(up.fake.requests) == 1
    # and a reload that removes it stops caching (and closes the old store)
    path.write_text(pool_policy([up.url]))
    assert (await reload(gw.root))[0] == 200
    assert gw.runtime.cache is None
    await gw.client.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    assert len(up.fake.requests) == 2


async def test_a_reload_naming_a_missing_artifact_is_refused(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    small, large = await make_fake(), await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(pool_policy([small.url]))
    gw = await make_gateway(path.read_text(), policy_path=path)
    backends = {"up": vllm(small.url), "large": {"kind": "openai", "base_url": large.url}}
    models = {
        "m": {"backend": "up", "model": "fake-model"},
        "auto": {"tiers": ["up", "large"], "artifact": "/nonexistent/difficulty.json"},
    }
    path.write_text(build_policy(backends, models))
    status, text = await reload(gw.root)
    assert status == 400
    assert f"{path}:" in text and "models.auto.artifact: cannot load the tier artifact" in text
    assert "auto" not in gw.runtime.policy.models  # the running policy is unchanged
    r = await gw.client.chat.completions.create(model="m", messages=MESSAGES)
    assert r.choices[0].message.content
