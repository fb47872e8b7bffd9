"""/metrics survives hostile model names and counts every API request (issue 12, item 7), and
every answer carries the caller's request id, streams included (item 6)."""

from __future__ import annotations

import os
import random
import re
from typing import Any

import aiohttp
import openai
import pytest

from bench._attack_http import build, send
from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm


def policy(url: str) -> str:
    return build_policy(
        {"up": vllm(url)},
        {"m": {"backend": "up", "model": "fake-model"}},
        tenants={"a": {"api_key_sha256": ["0" * 64]}},
        server={"max_body_bytes": 4096},
    )


def requests_total(text: str, model: str, status: int) -> float:
    pattern = rf'llm_gateway_requests_total{{[^}}]*model="{re.escape(model)}"[^}}]*status="{status}"[^}}]*}} (\S+)'
    found = re.findall(pattern, text)
    return sum(float(v) for v in found)


async def test_unknown_and_hostile_model_names_never_become_labels(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(
        build_policy(
            {"up": vllm(fake.url)},
            {"m": {"backend": "up", "model": "fake-model"}},
            server={"max_body_bytes": 4096},
        )
    )
    rng = random.Random(7)
    names = [
        "".join(rng.choice("abcxyz019-_./ \u00e9\u4e2d") for _ in range(24)) for _ in range(300)
    ]
    message = [{"role": "user", "content": "x"}]
    bodies: list[tuple[str, dict[str, Any]]] = [  # every API (Messages, Responses: raw names)
        ("/chat/completions", {"messages": message}),
        ("/responses", {"input": "x"}),
        ("/messages", {"max_tokens": 5, "messages": message}),
    ]
    async with aiohttp.ClientSession() as s:
        for i, name in enumerate(names):
            path, body = bodies[i % len(bodies)]
            async with s.post(gw.base_url + path, json={"model": name, **body}) as r:
                assert r.status == 404
        async with s.post(
            gw.base_url + "/chat/completions",
            data=b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 400
        async with s.post(
            gw.base_url + "/chat/completions",
            data=b"{",
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 400
        async with s.post(
            gw.base_url + "/chat/completions",
            data=b"x" * 5000,
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 413
        await gw.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
        async with s.get(gw.root + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    assert len(text) < 60_000
    assert not any(name in text for name in names)
    assert requests_total(text, "unknown", 404) == 300
    assert requests_total(text, "unknown", 400) == 2
    assert requests_total(text, "unknown", 413) == 1
    assert requests_total(text, "m", 200) == 1


async def test_unauthorized_requests_are_counted(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url), api_key="wrong-key-123")
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError):
            await gw.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
    text = gw.metrics.render().decode()
    assert requests_total(text, "unknown", 401) == 3


def sent_id(fake: Any) -> str | None:
    """The x-request-id the upstream received last."""
    headers = {k.lower(): v for k, v in fake.fake.requests[-1].headers.items()}
    return headers.get("x-request-id")


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_carry_the_callers_request_id_not_the_upstreams(
    make_fake: FakeFactory, make_gateway: GatewayFactory, stream: bool
) -> None:
    fake = await make_fake()
    gw = await make_gateway(
        build_policy({"up": vllm(fake.url)}, {"m": {"backend": "up", "model": "fake-model"}})
    )
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=stream,
        extra_headers={"X-Request-Id": "caller-id-42"},
    )  # fmt: skip
    assert raw.headers.get_list("x-request-id") == ["caller-id-42"]
    sent = {k.lower(): v for k, v in fake.fake.requests[-1].headers.items()}
    assert sent["x-request-id"] == "caller-id-42"  # and forwarded upstream
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=stream,
    )  # fmt: skip
    ids = raw.headers.get_list("x-request-id")
    assert len(ids) == 1 and ids[0] != "fake-upstream-request-id"
    # the gateway's own id goes upstream too (it sent none), and never a raw id it replaced
    assert sent_id(fake) == ids[0]
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=stream,
        extra_headers={"X-Request-Id": "x" * 300},
    )  # fmt: skip
    ids = raw.headers.get_list("x-request-id")
    assert len(ids) == 1 and sent_id(fake) == ids[0]
    # a caller's id that is not printable ASCII is not echoed: a fresh one is made
    port = int(gw.root.rsplit(":", 1)[1])
    answer = await send(port, build("GET", "/healthz", [(b"X-Request-Id", b"id-\xc3\xa9\xff")]), 10)
    assert answer.status == 200
    assert re.fullmatch(r"[0-9a-f]{24}", answer.headers["x-request-id"])


def test_request_ids_never_repeat_within_a_process_or_across_forked_workers() -> None:
    from gateway.middleware import _new_request_id

    ids = {_new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker forked from this process draws its own prefix
        os.write(write, _new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child not in ids and child[:16] != next(iter(ids))[:16]
