"""Bad input, auth and reload: each gets OpenAI's error JSON with the right status."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, build_policy, vllm


def policy(url: str, extra: str = "", **more: Any) -> str:
    """One fake backend serving ``m``, with a 2 KiB body limit; ``more``: backends and models."""
    backends = {"up": vllm(url), **more.pop("backends", {})}
    models = {"m": {"backend": "up", "model": "fake-model"}, **more.pop("models", {})}
    return build_policy(backends, models, extra, server={"max_body_bytes": 2048}, **more)


async def post(
    gw: RunningGateway, path: str, data: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as r,
    ):
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", b'{"model": "m", "messages": [', None),
        ("/chat/completions", b"[1, 2]", None),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        ("/chat/completions", b'{"model": "m"}', "messages"),
        ("/chat/completions", b'{"model": "m", "messages": "hi"}', "messages"),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"content": "x"}]}',
            "messages[0].role",
        ),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
            "messages[0].content",
        ),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": "9"}',
            "max_tokens",
        ),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}',
            "stream",
        ),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user"}], "temperature": "hot"}',
            "temperature",
        ),
        (
            "/chat/completions",
            b'{"model": "m", "messages": [{"role": "user"}], "n": 100000}',
            "n",
        ),
        ("/chat/completions", b'{"model": "m", "messages": [{"role": "user"}], "n": 0}', "n"),
        ("/completions", b'{"model": "m", "prompt": "x", "best_of": 1000}', "best_of"),
        ("/completions", b'{"model": "m"}', "prompt"),
        ("/completions", b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
        ("/chat/completions", b"\xff\xfe", None),
    ],
)
async def test_malformed_requests_are_400(
    make_fake: FakeFactory, make_gateway: GatewayFactory, path: str, body: bytes, param: str | None
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url))
    status, payload = await post(gw, path, body)
    assert status == 400
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == param
    assert "Traceback" not in payload["error"]["message"]
    assert up.fake.requests == []  # nothing reached the upstream


async def test_body_over_limit_is_413(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url))
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 4096 + b'"}]}'
    status, payload = await post(gw, "/chat/completions", big)
    assert status == 413
    assert payload["error"]["code"] == "body_too_large"

    async def chunked() -> Any:
        yield big[:100]
        yield big[100:]

    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + "/chat/completions",
            data=chunked(),
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 413
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * 4096}]
        )
    assert info.value.status_code == 413


async def test_unknown_model_is_404(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url))
    with pytest.raises(openai.NotFoundError) as info:
        await gw.client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_unknown_route_is_404_json(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url))
    async with aiohttp.ClientSession() as s, s.get(gw.base_url + "/embeddingz") as r:
        assert r.status == 404
        assert (await r.json())["error"]["type"] == "not_found_error"
    async with aiohttp.ClientSession() as s, s.get(gw.base_url + "/chat/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert "error" in await r.json()
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat%2Fcompletions") as r:
        assert r.status == 404  # named as sent, not as the route it decodes to
        assert (await r.json())["error"]["message"] == "unknown route POST /v1/chat%2Fcompletions"
    for method, path in [
        ("GET", "/messages"),
        ("PUT", "/messages"),
        ("GET", "/messages/count_tokens"),
    ]:
        async with aiohttp.ClientSession() as s, s.request(method, gw.base_url + path) as r:
            # Anthropic's routes answer in Anthropic's format (they answered OpenAI's)
            assert r.status == 405
            body = await r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


DIGEST_B = hashlib.sha256(b"key-of-team-b-123").hexdigest()
TENANTS = (
    "tenants:\n"
    '  team-a: {api_keys: ["${TEST_TENANT_A_KEY}"]}\n'
    f'  team-b: {{api_key_sha256: ["{DIGEST_B}"]}}\n'
)


async def test_tenant_keys(
    make_fake: FakeFactory, make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_TENANT_A_KEY", "key-of-team-a-123")
    up = await make_fake()
    gw = await make_gateway(policy(up.url, TENANTS))
    messages: Any = [{"role": "user", "content": "x"}]
    for key in ("key-of-team-a-123", "key-of-team-b-123"):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        r = await client.chat.completions.create(model="m", messages=messages)
        assert r.choices
        await client.close()
    bad = openai.AsyncOpenAI(base_url=gw.base_url, api_key="wrong-key-xyz", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await bad.chat.completions.create(model="m", messages=messages)
    assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()
    status, _ = await post(
        gw, "/chat/completions", b'{"model": "m", "messages": [{"role": "user"}]}'
    )
    assert status == 401  # no key at all
    # The client's key never travels upstream.
    assert all("Authorization" not in r.headers for r in up.fake.requests)


async def test_reload_keeps_running_policy_when_new_one_is_bad(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    up = await make_fake()
    other = await make_fake(models=("second",))
    path = tmp_path / "policy.yaml"
    path.write_text(policy(up.url))
    gw = await make_gateway(path.read_text(), policy_path=path)

    async def reload() -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
            return r.status, (await r.json()).get("error", {}).get("message", "")

    path.write_text(policy(up.url, models={"m2": {"backend": "nowhere"}}))
    status, message = await reload()
    assert status == 400
    assert re.search(
        rf"{re.escape(str(path))}:\d+: models.m2.backend: no backend named 'nowhere'", message
    )
    assert "m2" not in gw.runtime.policy.models  # still the old policy
    path.write_text(policy(up.url, backends2=1))
    status, message = await reload()
    assert status == 400 and "backends2: unknown key" in message
    good = policy(up.url, backends={"two": vllm(other.url)}, models={"m2": {"backend": "two"}})
    path.write_text(good)
    old_pool = gw.runtime.pools["up"]
    assert (await reload())[0] == 200
    rt = gw.runtime
    assert "m2" in rt.policy.models
    assert rt.pools["up"] is old_pool  # unchanged backends keep their state
    await gw.client.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}])
    assert other.fake.requests[-1].body["model"] == "second"
