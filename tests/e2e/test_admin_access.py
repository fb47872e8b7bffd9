"""Who may use the admin API (issue 12, item 14), /readyz without the policy's path, and a
reload of a hostile file rejected cleanly while traffic goes on (item 15)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.admin import ADMIN_ACCESS
from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm

TOKEN = "admin-token-0123456789"


def policy(url: str, **server: Any) -> str:
    return build_policy(
        {"up": vllm(url)}, {"m": {"backend": "up", "model": "fake-model"}}, server=server
    )


async def call(
    root: str, method: str, path: str, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.request(method, root + path, headers=headers) as r:
        return r.status, await r.json()


ADMIN = [("POST", "/admin/reload"), ("GET", "/admin/surfaces"), ("DELETE", "/admin/cache?tenant=t")]


async def test_with_a_token_every_admin_call_needs_it_even_from_loopback(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", TOKEN)
    fake = await make_fake()
    path = tmp_path / "p.yaml"
    path.write_text(policy(fake.url, admin_token_env="ADMIN_TOKEN"))
    gw = await make_gateway(path.read_text(), policy_path=path)
    for method, route in ADMIN:  # a proxy on the host makes every caller look like loopback
        for token in (None, "wrong", TOKEN + "x"):
            status, body = await call(gw.root, method, route, token)
            assert status == 401, (route, token)
            assert body["error"]["code"] == "invalid_admin_token"
    assert (await call(gw.root, "POST", "/admin/reload", TOKEN))[0] == 200
    assert (await call(gw.root, "GET", "/admin/surfaces", TOKEN))[0] == 200


async def test_without_a_token_a_gateway_bound_beyond_loopback_keeps_admin_off(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    fake = await make_fake()
    path = tmp_path / "p.yaml"
    path.write_text(policy(fake.url))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert (await call(gw.root, "POST", "/admin/reload"))[0] == 200  # loopback bind: as before
    gw.app[ADMIN_ACCESS].listens_beyond_loopback = True  # what `serve --host 0.0.0.0` sets
    for method, route in ADMIN:
        status, body = await call(gw.root, method, route)
        assert status == 403
        assert body["error"]["code"] == "admin_token_required"


async def test_without_a_token_a_browser_page_or_a_rebound_host_name_is_refused(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A page open on the operator's machine can make the browser POST to loopback (no
    preflight for a simple request), and DNS rebinding lets it read answers under its own host
    name: without a token only tools (no Origin, no Sec-Fetch-Site, a loopback Host) get in."""
    fake = await make_fake()
    path = tmp_path / "p.yaml"
    path.write_text(policy(fake.url))
    gw = await make_gateway(path.read_text(), policy_path=path)
    async with aiohttp.ClientSession() as s:
        for headers in (
            {"Origin": "https://evil.example"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Host": "rebind.attacker.example"},
            {"Host": "rebind.attacker.example:8080"},
        ):
            for method, route in ADMIN:
                async with s.request(method, gw.root + route, headers=headers) as r:
                    assert r.status == 403, (headers, route)
                    assert (await r.json())["error"]["code"] == "admin_token_required"
        for headers in (
            {"Host": "localhost:8080"},
            {"Host": "[::1]:8080"},
            {"Sec-Fetch-Site": "none"},
        ):
            async with s.get(gw.root + "/admin/surfaces", headers=headers) as r:
                assert r.status == 200, headers


async def test_readyz_does_not_print_the_policy_path(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    fake = await make_fake()
    path = tmp_path / "secret-dir" / "p.yaml"
    path.parent.mkdir()
    path.write_text(policy(fake.url))
    gw = await make_gateway(path.read_text(), policy_path=path)
    status, body = await call(gw.root, "GET", "/readyz")
    assert status == 200
    assert str(tmp_path) not in str(body) and "secret-dir" not in str(body)


async def test_reloading_an_alias_bomb_is_refused_quickly_while_traffic_goes_on(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    fake = await make_fake()
    path = tmp_path / "p.yaml"
    path.write_text(policy(fake.url))
    gw = await make_gateway(path.read_text(), policy_path=path)
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join(f"*{prev}" for _ in range(9)) + "]")
    path.write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    reload = asyncio.create_task(call(gw.root, "POST", "/admin/reload"))
    answered = 0
    while not reload.done():  # live traffic during the reload
        r = await gw.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        answered += bool(r.choices)
    status, body = await reload
    assert time.perf_counter() - started < 5
    assert status == 400
    assert "aliases" in body["error"]["message"]
    assert answered >= 1
    path.write_bytes(b"backends:\n  up: {kind: vllm, replicas: [\x00]}\n")
    status, body = await call(gw.root, "POST", "/admin/reload")
    assert status == 400 and "p.yaml:2" in body["error"]["message"]


async def test_metrics_can_ask_for_a_token(
    make_fake: FakeFactory, make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics labels name tenants, their spend and the replicas' addresses: with
    ``server.metrics_token_env`` only a scraper with the token reads them."""
    monkeypatch.setenv("METRICS_TOKEN", "metrics-token-0123456789")
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, metrics_token_env="METRICS_TOKEN"))
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
            async with s.get(gw.root + "/metrics", headers=headers) as r:
                assert r.status == 401
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert (await r.json())["error"]["code"] == "invalid_metrics_token"
        good = {"Authorization": "Bearer metrics-token-0123456789"}
        async with s.get(gw.root + "/metrics", headers=good) as r:
            assert r.status == 200
            assert "llm_gateway_requests_total" in await r.text()
    plain = await make_gateway(policy(fake.url))  # without the setting: open, as before
    async with aiohttp.ClientSession() as s, s.get(plain.root + "/metrics") as r:
        assert r.status == 200
