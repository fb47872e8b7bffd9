"""The lean HTTP/1.1 client against raw servers on loopback that answer byte for byte as told.

Each server reads one request head and body at a time and writes what the test says, so the
framings, failures and timings aiohttp's client handled are each shown to hold here too.
"""

from __future__ import annotations

import asyncio
import gzip
import inspect
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import uvloop

from routing.http1 import Http1Pool
from routing.http1_connection import HIGH_WATER, STALE_WINDOW_S
from routing.http1_errors import (
    BadAnswer,
    CannotConnect,
    Disconnected,
    HeadTimeout,
    NoFreeConnection,
    Silent,
)
from routing.http1_response import DECODE_STEP, Http1Response

Writer = asyncio.StreamWriter
Answer = Callable[[asyncio.StreamReader, Writer, int], Awaitable[bool]]  # False: close


def on_both_loops(case: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the case on a fresh asyncio loop and on a fresh uvloop (the gateway's): transports
    and timers differ between the two."""

    def test(loop: str, **params: object) -> None:
        (asyncio.run if loop == "asyncio" else uvloop.run)(case(**params))

    signature = inspect.signature(case)
    first = inspect.Parameter("loop", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)
    test.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[first, *signature.parameters.values()]
    )
    test.__name__ = case.__name__
    test.__doc__ = case.__doc__
    return pytest.mark.parametrize("loop", ["asyncio", "uvloop"])(test)


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a client closed a connection


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@asynccontextmanager
async def serve(answer: Answer) -> AsyncIterator[tuple[Server, int]]:
    server = Server()

    async def handle(reader: asyncio.StreamReader, writer: Writer) -> None:
        server.connections += 1
        try:
            while (request := await read_request(reader)) is not None:
                server.requests.append(request)
                if not await answer(reader, writer, len(server.requests)):
                    break
                await writer.drain()
            else:
                server.closed.set()
        except ConnectionError:
            server.closed.set()
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, port
    finally:
        listener.close()


async def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Polls ``condition`` (a bounded wait, not a fixed sleep a loaded machine can outlast)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not condition():
        assert loop.time() < deadline, "never came true"
        await asyncio.sleep(0.005)


async def body_arrived(response: Http1Response) -> None:
    await until(lambda: response._eof)


def sized(body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def post(pool: Http1Pool, body: bytes = b"{}", **limits: float) -> bytes:
    response = await pool.post(
        "/v1/chat/completions",
        body,
        [("Content-Type", "application/json")],
        connect_s=limits.get("connect_s", 2.0),
        first_byte_s=limits.get("first_byte_s", 5.0),
        idle_s=limits.get("idle_s", 5.0),
    )
    data = await response.read()
    response.release()
    return data


@on_both_loops
async def test_sized_answers_reuse_one_connection_and_the_request_is_sent_whole() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(sized(b'{"n": %d}' % n))
        return True

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool, b'{"a": 1}') == b'{"n": 1}'
        assert await post(pool, b'{"b": 2}') == b'{"n": 2}'
        pool.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{port}\r\n".encode() in first
    assert b"Content-Length: 8\r\n" in first and first.endswith(b'\r\n\r\n{"a": 1}')


@on_both_loops
async def test_chunked_answers_with_extensions_and_trailers_arriving_byte_by_byte() -> None:
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n"
        b"7\r\n, world\r\n"
        b"0\r\nX-Trailer: yes\r\n\r\n"
    )

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        for i in range(len(wire)):
            writer.write(wire[i : i + 1])
            await writer.drain()
        return True

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == b"hello, world"
        assert await post(pool) == b"hello, world"  # the connection was reusable after it
        pool.close()
    assert server.connections == 1


@on_both_loops
async def test_an_answer_without_length_ends_with_its_connection() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        return False

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == b"until the end"
        assert await post(pool) == b"until the end"
        pool.close()
    assert server.connections == 2  # such a connection is never reused


@on_both_loops
async def test_interim_answers_are_skipped_and_empty_statuses_have_no_body() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        if n == 1:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + sized(b"{}"))
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        return True

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == b"{}"
        response = await pool.post(
            "/x", b"", [], connect_s=1, first_byte_s=1, idle_s=1
        )  # 204: done at once
        assert response.status == 204 and await response.read() == b""
        response.release()
        assert await post(pool) == b""  # the same connection, still in step
        pool.close()
    assert server.connections == 1


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),  # zlib-wrapped, as RFC 9110 says
        ("deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),  # raw, as some send
    ],
)
@on_both_loops
async def test_compressed_answers_are_decoded(
    coding: str, compress: Callable[[bytes], bytes]
) -> None:
    text = b'{"choices": [{"text": "' + b"abc" * 5000 + b'"}]}'

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(sized(compress(text), f"Content-Encoding: {coding}\r\n"))
        return True

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == text
        pool.close()


@on_both_loops
async def test_a_compressed_bomb_is_decoded_a_step_at_a_time_and_a_cut_one_fails() -> None:
    bomb = gzip.compress(b"\0" * (20 * DECODE_STEP))  # ~5 MiB from ~5 KiB

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        body = bomb if n == 1 else bomb[: len(bomb) // 2]
        writer.write(sized(body, "Content-Encoding: gzip\r\n"))
        return True

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=2, idle_s=2)
        sizes = []
        while data := await response.readany():
            sizes.append(len(data))
        response.release()
        assert sum(sizes) == 20 * DECODE_STEP and max(sizes) <= DECODE_STEP
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=2, idle_s=2)
        with pytest.raises(BadAnswer):
            await response.read()
        pool.close()


@on_both_loops
async def test_a_reused_connection_the_server_closed_is_retried_on_a_new_one() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(sized(b'{"n": %d}' % n))
        return False  # keep-alive said, then the connection closed (an expired keep-alive)

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == b'{"n": 1}'
        await asyncio.sleep(0.05)  # the close arrives while the connection idles
        assert await post(pool) == b'{"n": 2}'
        pool.close()
    assert server.connections == 2


@on_both_loops
async def test_a_request_on_stale_connections_is_sent_once_more_on_a_new_one_only() -> None:
    gate = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        if n <= 4:  # four requests at once: four warm connections
            await gate.wait()
            writer.write(sized(b"{}"))
            return True
        writer.transport.abort()  # a replica that restarted: every old connection is dead
        return False

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        warm = [asyncio.create_task(post(pool)) for _ in range(4)]
        await until(lambda: len(server.requests) == 4)  # all four in, none answered yet
        gate.set()
        await asyncio.gather(*warm)
        assert server.connections == 4
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(pool)
        # Before: the request went out again on every idle connection (5 copies here).
        assert len(server.requests) == 6  # the four, then one on a stale one, one on a new one
        assert server.connections == 5
        pool.close()


@on_both_loops
async def test_a_reused_connection_closed_long_after_the_request_is_not_resent() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        if n == 1:
            writer.write(sized(b"{}"))
            return True
        await asyncio.sleep(STALE_WINDOW_S + 0.2)  # it worked on the request, then died
        writer.transport.abort()
        return False

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        assert await post(pool) == b"{}"
        with pytest.raises(aiohttp.ServerDisconnectedError) as caught:
            await post(pool)
        assert isinstance(caught.value, Disconnected)
        assert len(server.requests) == 2  # before: sent again, the replica got it twice
        pool.close()


@on_both_loops
async def test_a_connection_closed_mid_answer_is_a_disconnect() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        return False

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        with pytest.raises(aiohttp.ServerDisconnectedError) as caught:
            await post(pool)
        assert isinstance(caught.value, Disconnected)
        pool.close()


@on_both_loops
async def test_no_head_in_time_is_a_timeout_and_the_replica_sees_the_request_go() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        await reader.read()  # never answers; returns when the client closes
        server.closed.set()
        return False

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError) as caught:
            await post(pool, first_byte_s=0.3)
        assert isinstance(caught.value, HeadTimeout)
        assert 0.25 <= loop.time() - started < 2.0
        await asyncio.wait_for(server.closed.wait(), 2)
        assert pool.open_connections == 0
        pool.close()


@on_both_loops
async def test_silence_mid_body_past_idle_s_fails_the_read() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nsome")
        await writer.drain()
        await reader.read()
        return False

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=1, idle_s=0.3)
        assert await response.readany() == b"some"
        with pytest.raises(TimeoutError) as caught:
            await asyncio.wait_for(response.readany(), 3)
        assert isinstance(caught.value, Silent)
        response.close()
        pool.close()


@on_both_loops
async def test_at_most_max_connections_open_and_the_next_request_waits_for_one() -> None:
    gate = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        if n == 1:
            await gate.wait()
        writer.write(sized(b'{"n": %d}' % n))
        return True

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 1)
        first = asyncio.create_task(post(pool))
        second = asyncio.create_task(post(pool))
        await until(lambda: len(server.requests) == 1)
        await asyncio.sleep(0.2)  # time for a second connection, were one opened
        assert not second.done() and server.connections == 1 and pool.open_connections == 1
        gate.set()
        assert await first == b'{"n": 1}'
        assert await second == b'{"n": 2}'
        with pytest.raises(NoFreeConnection):  # a slot that never frees ends at first_byte_s
            held = await pool.post("/x", b"", [], connect_s=1, first_byte_s=1, idle_s=1)
            await post(pool, first_byte_s=0.2)
        held.close()
        pool.close()
    assert server.connections == 1


@on_both_loops
async def test_closing_an_answer_mid_body_closes_its_connection() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nsome\r\n")
        await writer.drain()
        await reader.read()  # returns once the client closed
        server.closed.set()
        return False

    async with serve(answer) as (server, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=1, idle_s=1)
        assert await response.readany() == b"some"
        response.close()
        await asyncio.wait_for(server.closed.wait(), 2)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await response.readany()
        pool.close()


@pytest.mark.parametrize(
    "wire",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n" + b"a" * 16,
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\nxx",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\nSet-Cookie: injected=1\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\rSet-Cookie: injected=1\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: 1\x00\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=[
        "not-http",
        "status",
        "header",
        "two-lengths",
        "negative-length",
        "chunk-size",
        "chunk-size-underscore",
        "length-not-ascii",
        "chunk-overrun",
        "unknown-coding",
        "huge-head",
        "bare-lf-in-head",
        "bare-cr-in-head",
        "nul-in-head",
    ],
)
@on_both_loops
async def test_answers_that_break_framing_are_errors_never_bodies(wire: bytes) -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(wire)
        await writer.drain()
        await asyncio.sleep(0.2)
        return False

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        with pytest.raises(aiohttp.ClientError):
            await post(pool)
        pool.close()


@on_both_loops
async def test_a_slow_reader_pauses_reading_and_gets_every_byte() -> None:
    body = bytes(range(256)) * (4 * HIGH_WATER // 256)

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(sized(body))
        return True

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=2, idle_s=2)
        conn = response._conn
        assert conn is not None
        await until(lambda: conn.paused)  # the server writes on; the client buffers at most ~HIGH
        await asyncio.sleep(0.1)  # and stays paused
        assert conn.paused and response._size <= HIGH_WATER + 256 * 1024
        parts = []
        while data := await response.readany():
            parts.append(data)
        assert b"".join(parts) == body
        response.release()
        assert await post(pool) == body  # the connection went back in step
        pool.close()


@on_both_loops
async def test_headers_that_would_split_the_request_are_refused_and_no_server_is_a_connect_error() -> (
    None
):
    pool = Http1Pool("127.0.0.1", 9, 10)  # discard port: nothing listens
    with pytest.raises(ValueError, match="cannot be sent"):
        await pool.post("/x", b"", [("X-A", "1\r\nX-B: 2")], connect_s=1, first_byte_s=1, idle_s=1)
    with pytest.raises(CannotConnect):
        await post(pool)
    assert pool.open_connections == 0
    pool.close()


@on_both_loops
async def test_what_arrived_together_is_read_together() -> None:
    events = [b"data: %d\n\n" % i for i in range(3)]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(wire)  # three events in one segment: one read, as aiohttp's readany
        return True

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=1, idle_s=1)
        reads = [data async for data in response.iter_any()]
        assert reads == [b"".join(events)]
        response.release()
        pool.close()


@on_both_loops
async def test_a_body_that_came_with_its_head_is_taken_whole_within_its_limit() -> None:
    async def answer(reader: asyncio.StreamReader, writer: Writer, n: int) -> bool:
        extra = "Content-Encoding: gzip\r\n" if n == 3 else ""
        writer.write(sized(gzip.compress(b"{}") if n == 3 else b'{"n": %d}' % n, extra))
        return True

    async with serve(answer) as (_, port):
        pool = Http1Pool("127.0.0.1", port, 10)
        for limit, expected in ((100, b'{"n": 1}'), (3, None), (100, None)):
            response = await pool.post("/x", b"", [], connect_s=1, first_byte_s=1, idle_s=1)
            await body_arrived(response)
            assert response.whole(limit) == expected  # over the limit, or compressed: no
            if expected is None:  # the reader's path takes it (and refuses or decodes it)
                assert await response.read() in (b'{"n": 2}', b"{}")
            response.release()
        pool.close()
