"""First contact (issue 12, items 17 to 19): the demo's port, what cache headers say, cached
answers that look like live ones, the access log, faiss's start-up noise, `check` reporting
every problem at once, CORS, and a photo-sized body under the default limit."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import main as cli_main
from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm

ROOT = Path(__file__).resolve().parents[2]
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def policy(url: str, **sections: Any) -> str:
    return build_policy(
        {"up": vllm(url)}, {"m": {"backend": "up", "model": "fake-model"}}, **sections
    )


def test_demo_checks_its_port_before_starting_vllm() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "deploy.local.demo", "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2
    assert f"port {port}" in proc.stderr and "DEMO_PORT=" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout  # no vLLM was started


async def test_cache_hits_look_like_live_answers_and_skips_say_why(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    cached = {"default": {"cache": {"exact": True}}}
    server = {"route_detail_headers": True}  # x-gateway-route-reason, read below
    gw = await make_gateway(policy(up.url, surfaces=cached, server=server))
    live = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=QUESTION, temperature=0
    )
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    assert live.headers["x-gateway-cache"] == "miss"
    for stream in (False, True):
        hit = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=QUESTION, temperature=0, stream=stream,
            extra_headers={"X-Request-Id": f"hit-{stream}"},
        )  # fmt: skip
        assert hit.headers["x-gateway-cache"] == "exact"
        assert hit.headers["x-gateway-replica"] == "cache"
        assert hit.headers["x-gateway-route-reason"] == "cache_exact"
        assert hit.headers["x-request-id"] == f"hit-{stream}"
        parsed = hit.parse()
        models = (
            {chunk.model async for chunk in parsed}  # type: ignore[union-attr]
            if stream
            else {parsed.model}  # type: ignore[union-attr]
        )
        assert models == {live.parse().model} == {"fake-model"}  # the served model, as live
    skipped = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=QUESTION, temperature=0, extra_headers={"Cache-Control": "no-cache"}
    )
    assert skipped.headers["x-gateway-cache"] == "skip"
    assert skipped.headers["x-gateway-cache-skip"] == "no-cache"
    hot = await gw.client.chat.completions.with_raw_response.create(model="m", messages=QUESTION)
    assert (hot.headers["x-gateway-cache"], hot.headers["x-gateway-cache-skip"]) == (
        "skip",
        "temperature",
    )


@pytest.mark.parametrize("enabled", [True, False])
async def test_access_log_is_opt_in_and_carries_no_key_or_prompt(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    enabled: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="llm_gateway.access")
    up = await make_fake()
    key = "sk-access-log-key-0123456789"
    import hashlib

    tenants = {"a": {"api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}}
    gw = await make_gateway(
        policy(up.url, tenants=tenants, server={"access_log": enabled}), api_key=key
    )
    await gw.client.chat.completions.create(model="m", messages=QUESTION)
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/healthz") as r:
        assert r.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "llm_gateway.access"]
    if not enabled:
        assert lines == []
        return
    assert len(lines) == 2
    assert "POST /v1/chat/completions 200" in lines[0] and "model=m" in lines[0]
    assert "GET /healthz 200" in lines[1]
    assert not any(key in line or "capital of France" in line for line in lines)


async def test_access_log_names_the_replica_of_a_failed_attempt(
    make_fake: FakeFactory, make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose attempt timed out names the replica it went to (it said
    ``backend=- replica=-``), in the access log and in the request counter."""
    caplog.set_level(logging.INFO, logger="llm_gateway.access")
    up = await make_fake()
    backend = vllm(up.url, timeouts={"first_byte_s": 0.3})
    gw = await make_gateway(
        build_policy(
            {"up": backend},
            {"m": {"backend": "up", "model": "fake-model"}},
            server={"access_log": True},
        )
    )
    up.fake.queue("hang")
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.chat.completions.create(model="m", messages=QUESTION)
    assert info.value.status_code == 504
    replica = up.url.split("//")[1].removesuffix("/v1")
    lines = [r.getMessage() for r in caplog.records if r.name == "llm_gateway.access"]
    assert len(lines) == 1 and "POST /v1/chat/completions 504" in lines[0], lines
    assert f"model=m backend=up replica={replica} " in lines[0], lines[0]
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        metrics = await r.text()
    assert (
        f'llm_gateway_requests_total{{backend="up",model="m",replica="{replica}",status="504"}}'
        in metrics
    )


def test_faiss_loader_noise_is_gone() -> None:
    code = "import logging; logging.basicConfig(level=logging.INFO); import cache.index"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Could not load library" not in proc.stderr
    assert "ModuleNotFoundError" not in proc.stderr


def test_check_reports_every_problem_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "backends:\n"
        "  up:\n"
        '    kind: vllm\n    replicas: ["http://127.0.0.1:9/v1"]\n'
        "models:\n"
        "  m: {backend: nope}\n"
        "  t:\n"
        "    tiers: [{backend: up, model: small}, {backend: up, model: large}]\n"
        f"    artifact: {tmp_path}/missing-artifact.json\n"
        "tenants:\n"
        '  a: {api_keys: ["plaintext-key-123"]}\n'
    )
    assert cli_main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "models.m.backend: no backend named 'nope'" in err
    assert "plaintext API key" in err
    assert "models.t" in err and "artifact" in err  # prepare's problem, with the others
    assert "(3 problem(s))" in err


async def test_cors_is_opt_in(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake()
    origin = "https://app.example"
    gw = await make_gateway(policy(up.url, server={"cors": {"allow_origins": [origin]}}))
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with aiohttp.ClientSession() as s:
        async with s.options(gw.base_url + "/chat/completions", headers=preflight) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == origin
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
        # what openai-js and anthropic-js send from a browser: names a pattern covers are
        # answered by name (browsers do not read "X-Stainless-*" as a pattern)
        sdk = {
            **preflight,
            "Access-Control-Request-Headers": (
                "authorization,content-type,x-stainless-os,x-stainless-lang,x-api-key,"
                "anthropic-version,anthropic-dangerous-direct-browser-access,x-not-allowed"
            ),
        }
        async with s.options(gw.base_url + "/chat/completions", headers=sdk) as r:
            assert r.status == 204
            allowed = {
                h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")
            }
            assert {
                "x-stainless-os",
                "x-stainless-lang",
                "x-api-key",
                "anthropic-version",
            } <= allowed
            assert "anthropic-dangerous-direct-browser-access" in allowed
            assert "x-not-allowed" not in allowed and "x-stainless-*" not in allowed
        other = {**preflight, "Origin": "https://evil.example"}
        async with s.options(gw.base_url + "/chat/completions", headers=other) as r:
            assert r.status == 403
            assert "Access-Control-Allow-Origin" not in r.headers
        for stream in (False, True):
            body = {"model": "m", "messages": QUESTION, "stream": stream}
            async with s.post(
                gw.base_url + "/chat/completions", json=body, headers={"Origin": origin}
            ) as r:
                assert r.status == 200
                assert r.headers["Access-Control-Allow-Origin"] == origin
                exposed = r.headers["Access-Control-Expose-Headers"].split(",")
                assert {"x-request-id", "request-id"} <= {h.strip() for h in exposed}
                await r.read()
    plain = await make_gateway(policy(up.url))
    async with aiohttp.ClientSession() as s:
        async with s.options(plain.base_url + "/chat/completions", headers=preflight) as r:
            assert r.status == 405
            assert "Access-Control-Allow-Origin" not in r.headers
        async with s.get(plain.root + "/healthz", headers={"Origin": origin}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers


async def test_cors_allows_the_header_that_selects_a_surface_whatever_its_name(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    origin = "https://app.example"

    async def allowed_headers(server: dict[str, Any], asked: str) -> set[str]:
        gw = await make_gateway(policy(up.url, server=server))
        preflight = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        }
        async with (
            aiohttp.ClientSession() as s,
            s.options(gw.base_url + "/chat/completions", headers=preflight) as r,
        ):
            assert r.status == 204
            return {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}

    renamed = {"cors": {"allow_origins": [origin]}, "surface_header": "X-Lane"}
    assert "x-lane" in await allowed_headers(renamed, "content-type, x-lane")
    assert "x-lane" in await allowed_headers(renamed, "content-type")  # listed unasked too
    # a CORS list of its own that leaves the surface header out still allows it
    own_list = {"cors": {"allow_origins": [origin], "allow_headers": ["Content-Type"]}}
    allowed = await allowed_headers(own_list, "content-type, x-surface, x-other")
    assert "x-surface" in allowed and "x-other" not in allowed


async def test_a_photo_sized_image_fits_the_default_body_limit(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url))  # no max_body_bytes: the default
    photo = base64.b64encode(os.urandom(3_600_000)).decode()  # a 3.6 MB JPEG is 4.8 MB of base64
    content: Any = [
        {"type": "text", "text": "What is in this photo?"},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}},
    ]
    r = await gw.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}]
    )
    assert r.choices[0].message.content
    sent = up.fake.requests[-1].body["messages"][0]["content"][1]["image_url"]["url"]
    assert len(json.dumps(sent)) > 4_700_000


async def test_access_log_lines_cannot_be_forged_and_every_end_is_logged(
    make_fake: FakeFactory, make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A percent-encoded newline in the path is logged as sent (no forged second line); a
    request id with spaces is replaced (it could pose as more fields); a client that leaves
    mid-stream still gets its line (499)."""
    caplog.set_level(logging.INFO, logger="llm_gateway.access")
    up = await make_fake(chunks=50, chunk_interval_ms=50)
    gw = await make_gateway(policy(up.url, server={"access_log": True}))
    forged = "/v1/x%0A2026-11-24 17:00:00,000 INFO llm_gateway.access: 10.0.0.9 POST /admin/reload"
    spoof = {"x-request-id": "a status=200 model=x"}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.root + forged.replace(" ", "%20"), headers=spoof) as r:
            assert r.status == 404
            assert r.headers["x-request-id"] != spoof["x-request-id"]
        async with s.get(gw.root + "/v1/x%E2%80%A8y") as r:
            assert r.status == 404
        body = {"model": "m", "messages": QUESTION, "stream": True}
        async with s.post(
            gw.root + "/v1/chat/completions", json=body, headers={"x-request-id": "left-1"}
        ) as r:
            await r.content.readline()  # the first event, then leave
    for _ in range(100):
        lines = [r.getMessage() for r in caplog.records if r.name == "llm_gateway.access"]
        if any("id=left-1" in line for line in lines):
            break
        await asyncio.sleep(0.05)
    assert len(lines) == 3, lines
    assert all("\n" not in line and "\u2028" not in line for line in lines)
    assert "GET /v1/x%0A2026-11-24%2017:00:00,000" in lines[0]
    assert "status=200" not in lines[0]
    assert "GET /v1/x%E2%80%A8y 404" in lines[1]
    assert "POST /v1/chat/completions 499" in lines[2] and "id=left-1" in lines[2]


async def test_dialect_errors_are_counted_like_chat_errors(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    import hashlib

    up = await make_fake()
    key = "sk-dialect-count-0123456789"
    tenants = {"a": {"api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}}
    gw = await make_gateway(policy(up.url, tenants=tenants), api_key=key)
    good = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s:
        for path, headers, data, status in (
            ("/v1/messages", {"x-api-key": "wrong-key-123456"}, b"{}", 401),
            ("/v1/messages", good, b"not json", 400),
            ("/v1/responses", good, b"not json", 400),
            ("/v1/responses", {}, b"{}", 401),
        ):
            async with s.post(gw.root + path, headers=headers, data=data) as r:
                assert r.status == status, (path, await r.text())
                if status == 401:  # RFC 9110: a 401 names the scheme it wants
                    assert r.headers["WWW-Authenticate"] == "Bearer"
        async with s.get(gw.root + "/v1/responses/resp_unknown", headers=good) as r:
            assert r.status == 404
        async with s.get(gw.root + "/metrics") as r:
            text = await r.text()
    counts = {
        (sample.labels["model"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_gateway_requests"
        for sample in family.samples
        if sample.name == "llm_gateway_requests_total"
    }
    assert counts == {("unknown", "401"): 2, ("unknown", "400"): 2, ("unknown", "404"): 1}


def test_cors_wildcard_with_credentials_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        policy(
            "http://127.0.0.1:9/v1",
            server={"cors": {"allow_origins": ["*"], "allow_credentials": True}},
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "server.cors: allow_credentials with allow_origins '*'" in proc.stderr, proc.stderr


async def test_unknown_parameters_of_translated_apis_are_refused_by_name(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A parameter the translation does not read would change nothing: a 400 naming it, as the
    providers answer, not an answer that silently ignored it (Responses has no ``seed``, ``n``
    or ``stop``; Messages has no ``presence_penalty``)."""
    up = await make_fake()
    gw = await make_gateway(policy(up.url))
    cases = [
        ("/v1/responses", {"model": "m", "input": "hi", "seed": 1}, "seed"),
        ("/v1/responses", {"model": "m", "input": "hi", "n": 3}, "n"),
        ("/v1/responses", {"model": "m", "input": "hi", "frobnicate": 1}, "frobnicate"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": QUESTION,
                          "presence_penalty": 1}, "presence_penalty"),
    ]  # fmt: skip
    async with aiohttp.ClientSession() as s:
        for path, body, name in cases:
            async with s.post(gw.root + path, json=body) as r:
                assert r.status == 400, (path, name)
                answer = await r.json()
                error = answer["error"]
                assert name in error["message"]
                if path == "/v1/responses":
                    assert error["param"] == name and error["code"] == "unknown_parameter"
                else:
                    assert answer["type"] == "error" and error["type"] == "invalid_request_error"
        known = [
            ("/v1/responses", {"model": "m", "input": "hi", "service_tier": "auto",
                               "prompt_cache_key": "k", "include": [], "metadata": {"a": "b"}}),
            ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": QUESTION,
                              "service_tier": "auto", "metadata": {"user_id": "u"}}),
        ]  # fmt: skip
        for path, body in known:
            async with s.post(gw.root + path, json=body) as r:
                assert r.status == 200, (path, await r.text())
    assert len(up.fake.requests) == 2  # the refused ones never went upstream
