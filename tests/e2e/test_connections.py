"""Client connections are bounded (issue 12, item 11): head and body deadlines, idle keep-alive,
and a cap on open connections where idle ones give way and the rest get a clear 503."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from bench._attack_http import build, send
from gateway.connections import SLOW_HEAD_S
from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm

GOOD = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def policy(url: str, **server: Any) -> str:
    return build_policy(
        {"up": vllm(url)}, {"m": {"backend": "up", "model": "fake-model"}}, server=server
    )


def port_of(root: str) -> int:
    return int(root.rsplit(":", 1)[1])


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; fails if it has not closed in time."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(), seconds)
    return data, time.monotonic() - started


async def answer_of(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One whole answer (its head, its body) read off a keep-alive connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


async def test_slow_request_head_gets_408_and_idle_socket_is_closed(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, header_timeout_s=0.5))
    port = port_of(gw.root)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):  # slowloris: a header line now and then, never the end
        await asyncio.sleep(0.1)
        writer.write(b"X-Slow: 1\r\n")
    data, waited = await closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b'"request_timeout"' in data
    assert waited < 2
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # connects, sends nothing
    data, waited = await closed_within(reader, 5)
    assert data == b""
    writer.close()
    assert fake.fake.requests == []


async def test_keep_alive_connection_is_closed_after_keepalive_timeout(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, keepalive_timeout_s=0.5, header_timeout_s=5))
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.root))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _ = await answer_of(reader)
    assert head.startswith(b"HTTP/1.1 200")
    data, waited = await closed_within(reader, 5)  # idle after its answer: closed at 0.5 s
    assert data == b""
    assert waited < 3
    writer.close()


async def test_a_head_arriving_gets_its_408_at_the_head_deadline_not_the_keepalive_one(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """keepalive_timeout_s shorter than header_timeout_s: aiohttp's keep-alive timer runs from a
    connection's start and would close a head still coming, with no answer."""
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, keepalive_timeout_s=0.3, header_timeout_s=1.5))
    port = port_of(gw.root)

    async def trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            for _ in range(20):  # a header line every 0.2 s, never the end
                await asyncio.sleep(0.2)
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    sender = asyncio.create_task(trickle(writer))
    data, waited = await closed_within(reader, 10)
    sender.cancel()
    assert data.startswith(b"HTTP/1.1 408"), data
    assert waited > 1.0  # the head deadline's, not the keep-alive bound's 0.3 s
    writer.close()

    # a later head on a keep-alive connection, begun and stalled: its 408 too
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await answer_of(reader)
    writer.write(b"POST /v1/chat/compl")
    data, _ = await closed_within(reader, 10)
    assert data.startswith(b"HTTP/1.1 408"), data
    writer.close()
    assert fake.fake.requests == []


async def test_slow_body_gets_408(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, body_timeout_s=0.5))
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.root))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{"
    )
    for _ in range(2):  # a byte now and then: the whole body never arrives
        await asyncio.sleep(0.15)
        writer.write(b" ")
    writer.write(b" " * 100)  # more body after the 408: never read as a next request
    data, elapsed = await closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b'"request_timeout"' in data
    assert b"connection: close" in data.lower() and data.count(b"HTTP/1.1") == 1
    # closed after aiohttp's lingering read of the rest (2 s), not after another head timeout
    assert elapsed < 4
    writer.close()
    assert fake.fake.requests == []


async def test_connection_cap_closes_idle_connections_then_refuses_with_503(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, max_client_connections=4, header_timeout_s=30))
    port = port_of(gw.root)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    for reader, writer in idle:  # each one served a request: idle between requests
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await answer_of(reader)
    # at the cap, a real client still gets through: the oldest idle connection gives way
    r = await gw.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content
    data, _ = await closed_within(idle[0][0], 2)
    assert data == b""
    for _, writer in idle:
        writer.close()
    await asyncio.sleep(0.1)

    # when every connection is busy, a new one gets a clear 503 and is closed
    fake.fake.queue(*["sleep:1.5"] * 4)
    raw = build("POST", "/v1/chat/completions", [(b"Content-Type", b"application/json")], GOOD)
    busy = [asyncio.create_task(send(port, raw, 10)) for _ in range(4)]
    for _ in range(500):  # all four reached the upstream (a bounded wait, not a fixed 0.5 s)
        if fake.fake.active == 4:
            break
        await asyncio.sleep(0.01)
    refused = await send(port, raw, 5)
    assert refused.status == 503, refused.body
    err = refused.error_json()
    assert err is not None and err["code"] == "too_many_connections"
    assert refused.headers.get("retry-after")
    assert [a.status for a in await asyncio.gather(*busy)] == [200] * 4
    # and the cap frees up again
    assert (await send(port, raw, 5)).status == 200


async def test_connections_just_accepted_stay_open_and_a_newcomer_gets_503(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Clients that connect together at the cap: those accepted have not sent their request
    yet, which is no reason to close them; the one over the cap is told so (a 503), never
    left with a bare disconnect."""
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, max_client_connections=2, header_timeout_s=30))
    port = port_of(gw.root)
    fresh = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await asyncio.sleep(0.2)  # accepted, and silent for a moment (well under SLOW_HEAD_S)
    newcomer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.2)
    for reader, writer in fresh:  # both still open: each sends its request and is answered
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = await closed_within(reader, 5)
        assert data.startswith(b"HTTP/1.1 200"), data
        writer.close()
    data, _ = await closed_within(newcomer[0], 5)
    assert data.startswith(b"HTTP/1.1 503"), data
    assert b'"too_many_connections"' in data
    newcomer[1].close()


async def test_silent_and_slow_header_connections_give_way_at_the_cap_after_a_while(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A flood of connections that send nothing, or a head a line at a time, holds the cap
    for SLOW_HEAD_S at most: then the oldest gives way to a real client."""
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, max_client_connections=2, header_timeout_s=30))
    port = port_of(gw.root)
    slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    slow[0][1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
    await asyncio.sleep(SLOW_HEAD_S + 0.5)
    r = await gw.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content
    data, _ = await closed_within(slow[0][0], 2)
    assert data == b""
    for _, writer in slow:
        writer.close()


async def test_reload_changes_connection_bounds(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Any
) -> None:
    fake = await make_fake()
    path = tmp_path / "policy.yaml"
    path.write_text(policy(fake.url, header_timeout_s=30))
    gw = await make_gateway(path.read_text(), policy_path=path)
    port = port_of(gw.root)
    path.write_text(policy(fake.url, header_timeout_s=0.3))
    reload = build("POST", "/admin/reload", [])
    assert (await send(port, reload, 10)).status == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    data, _ = await closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 408")
    writer.close()


async def test_slow_uploads_are_shed_at_the_cap_before_a_client_is_refused(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, max_client_connections=3, body_timeout_s=30))
    port = port_of(gw.root)
    slow = []
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        slow.append((reader, writer))
    await asyncio.sleep(2.5)  # past SLOW_BODY_S: every connection is a slow upload
    r = await gw.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content
    closed = 0
    for reader, writer in slow:
        with contextlib.suppress(TimeoutError):
            closed += await asyncio.wait_for(reader.read(), 0.5) == b""
        writer.close()
    assert closed >= 1
