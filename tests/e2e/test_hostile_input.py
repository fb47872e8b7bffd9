"""Hostile bodies and headers through the real gateway, on raw sockets where no client would
send such bytes: each is a clear OpenAI error with the right status, nothing reaches the
upstream, nothing reaches a log (issue 12, items 8, 9, 10 and 13's key padding)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib
from typing import Any

import pytest

from bench._attack_http import Answer, build, send
from tests.conftest import FakeFactory, GatewayFactory, RunningFake, build_policy, vllm

KEY = "sk-tenant-a-secret-0123456789"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}


def policy(url: str, **server: Any) -> str:
    return build_policy(
        {"up": vllm(url)},
        {"m": {"backend": "up", "model": "fake-model"}},
        tenants={"a": {"api_key_sha256": [__import__("hashlib").sha256(KEY.encode()).hexdigest()]}},
        surfaces={"default": {"cache": {"exact": True}}},  # the cache path hashes message text
        server=server,
    )


def port_of(root: str) -> int:
    return int(root.rsplit(":", 1)[1])


async def post_raw(
    root: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    auth: bytes | None = b"Bearer " + KEY.encode(),
    path: str = "/v1/chat/completions",
) -> Answer:
    head = [(b"Content-Type", b"application/json")]
    if auth is not None:
        head.append((b"Authorization", auth))
    return await send(port_of(root), build("POST", path, head + (headers or []), body), 20)


def openai_error(answer: Answer, status: int) -> dict[str, Any]:
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers.get("content-type", "").startswith("application/json")
    err = answer.error_json()
    assert err is not None, answer.body[:300]
    assert set(err) >= {"message", "type", "code"}
    assert "Traceback" not in answer.body.decode("utf-8", "replace")
    return err


async def start(
    make_fake: FakeFactory, make_gateway: GatewayFactory, **server: Any
) -> tuple[RunningFake, str]:
    fake = await make_fake()
    gw = await make_gateway(policy(fake.url, **server), api_key=KEY)
    return fake, gw.root


def dumped(**extra: Any) -> bytes:
    return json.dumps({**GOOD, **extra}).encode()


HOSTILE_JSON = {
    "nested 1,000 deep": b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "object nested 200 deep": dumped(metadata=0).replace(b'"metadata": 0', b'"metadata": ' + b'{"a": ' * 200 + b"1" + b"}" * 200),
    "integer of 5,000 digits": dumped(max_tokens=1).replace(b'"max_tokens": 1', b'"max_tokens": ' + b"9" * 5000),
    "float overflowing to inf": dumped(temperature=0.5).replace(b"0.5", b"1e999"),
    "NaN": dumped(temperature=0.5).replace(b"0.5", b"NaN"),
    "Infinity": dumped(top_p=0.5).replace(b"0.5", b"-Infinity"),
    "duplicate model key": b'{"model": "m", "model": "other", "messages": [{"role": "user", "content": "x"}]}',
    "duplicate key in a message": b'{"model": "m", "messages": [{"role": "user", "content": "x", "content": "y"}]}',
    "UTF-16 with BOM": json.dumps(GOOD).encode("utf-16"),
    "UTF-16LE": json.dumps(GOOD).encode("utf-16-le"),
    "UTF-8 BOM": b"\xef\xbb\xbf" + json.dumps(GOOD).encode(),
    "lone surrogate escape in message text": dumped().replace(b"hello", b"\\ud800"),
    "lone low surrogate in the model": dumped().replace(b'"m"', b'"\\udc80"', 1),
    "surrogate as CESU-8 bytes": dumped().replace(b"hello", b"\xed\xa0\x80"),
    "invalid UTF-8 byte": dumped().replace(b"hello", b"\xff"),
}  # fmt: skip


@pytest.mark.parametrize("body", list(HOSTILE_JSON.values()), ids=list(HOSTILE_JSON))
async def test_bodies_that_are_not_strict_json_are_400_and_never_forwarded(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    body: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    fake, root = await start(make_fake, make_gateway)
    err = openai_error(await post_raw(root, body), 400)
    assert err["type"] == "invalid_request_error"
    assert fake.fake.requests == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # the gateway still serves
    assert (await post_raw(root, dumped())).status == 200


async def test_a_body_of_millions_of_values_is_413_without_holding_the_loop(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Ten million ``{}`` (30 MB, under the body limit) held the event loop for 40 s and took
    1.5 GB, everyone's requests waiting (the probe's repro): past ``MAX_VALUES`` a body is a
    413 before it is parsed. Brackets and commas inside strings are text, not values, and
    100,000 brackets nested 120 deep a thousand times over pass without a walk of them."""
    fake, root = await start(make_fake, make_gateway, max_body_bytes=64 * 1024 * 1024)
    many = dumped(x=[]).replace(b'"x": []', b'"x": [' + b",".join([b"{}"] * 1_100_000) + b"]")
    err = openai_error(await post_raw(root, many), 413)
    assert "1,000,000 JSON values" in err["message"] and fake.fake.requests == []
    # An unclosed string of escaped quotes before a million commas: a regex taking the
    # strings out retried at every quote (49 s for 1 MB, the loop held); one pass now.
    unclosed = b'{"model": "m", "messages": "' + b'\\"' * 10_000 + b"," * 1_000_001
    started = time.monotonic()
    assert (await post_raw(root, unclosed)).status in (400, 413)
    assert time.monotonic() - started < 10
    text = "a, [b], {c}, " * 400_000  # 5 MB of text with 2 million commas and brackets
    answer = await post_raw(root, dumped(messages=[{"role": "user", "content": text}]))
    assert answer.status == 200, answer.body[:300]
    nested = b"[" * 120 + b"]" * 120
    deep = dumped(metadata=0).replace(
        b'"metadata": 0', b'"user": "u", "x": [' + b",".join([nested] * 1000) + b"]"
    )
    assert (await post_raw(root, deep)).status == 200
    too_deep = deep.replace(nested, b"[" * 7 + nested + b"]" * 7, 1)  # 129 levels, one place
    err = openai_error(await post_raw(root, too_deep), 400)
    assert "nested deeper than 128" in err["message"]


async def test_surrogate_pairs_and_escaped_backslashes_are_fine(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake, root = await start(make_fake, make_gateway)
    body = dumped().replace(b"hello", b"\\ud83d\\ude00 C:\\\\udev")
    answer = await post_raw(root, body)
    assert answer.status == 200, answer.body
    assert fake.fake.requests[-1].body["messages"][0]["content"] == "\U0001f600 C:\\udev"


async def test_compressed_bodies_are_decoded_under_the_body_limit(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    fake, root = await start(make_fake, make_gateway, max_body_bytes=65536)
    for encoding, data in (
        (b"gzip", gzip.compress(dumped())),
        (b"deflate", zlib.compress(dumped())),
        (b"deflate", zlib.compress(dumped())[2:-4]),  # raw deflate, as some clients send
    ):
        answer = await post_raw(root, data, [(b"Content-Encoding", encoding)])
        assert answer.status == 200, (encoding, answer.body)
        assert fake.fake.requests[-1].body["messages"][0]["content"] == "hello"
    forwarded = len(fake.fake.requests)

    # 61 KB on the wire inflating to 60 MiB: refused after at most the limit was inflated
    bomb = gzip.compress(
        b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (60 << 20) + b'"}]}'
    )
    err = openai_error(await post_raw(root, bomb, [(b"Content-Encoding", b"gzip")]), 413)
    assert err["code"] == "body_too_large"
    # within the wire limit, but decoding past max_body_bytes (ratio about 10x, honest text)
    text = " ".join(f"word{i % 5000}" for i in range(20_000)).encode()
    big = gzip.compress(dumped().replace(b"hello", text))
    assert len(big) < 65536 < len(dumped().replace(b"hello", text))
    openai_error(await post_raw(root, big, [(b"Content-Encoding", b"gzip")]), 413)
    # undecodable, truncated, or with trailing data (a second gzip member): 400
    for data in (
        b"not gzip at all",
        gzip.compress(dumped())[:-10],
        gzip.compress(dumped()) + gzip.compress(b"{}"),
    ):
        openai_error(await post_raw(root, data, [(b"Content-Encoding", b"gzip")]), 400)
    # encodings the gateway does not decode: 415 naming what it accepts
    for encoding in (b"br", b"zstd", b"gzip, gzip", b"x-evil"):
        err = openai_error(await post_raw(root, dumped(), [(b"Content-Encoding", encoding)]), 415)
        assert "gzip" in err["message"]
    assert len(fake.fake.requests) == forwarded


async def test_inflate_ratio_bounds_bombs_under_a_large_body_limit(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """With the default 64 MiB limit a 60 MiB bomb fits; its 1,000:1 ratio does not."""
    fake, root = await start(make_fake, make_gateway)
    bomb = gzip.compress(dumped().replace(b"hello", b"a" * (60 << 20)))
    err = openai_error(await post_raw(root, bomb, [(b"Content-Encoding", b"gzip")]), 413)
    assert "max_inflate_ratio" in err["message"]
    assert fake.fake.requests == []


BAD_AUTH = {
    "non-UTF-8 bytes": b"Bearer \xff\xfe" + KEY.encode(),
    "control character": b"Bearer " + KEY.encode() + b"\x01",
    "over 8 KB": b"Bearer " + KEY.encode() * 400,
    "key padded with spaces": b"Bearer  " + KEY.encode() + b" ",
    "UTF-8 letters": "Bearer ключ".encode() + KEY.encode(),
    "NUL byte": b"Bearer " + KEY.encode() + b"\x00",
}


@pytest.mark.parametrize("value", list(BAD_AUTH.values()), ids=list(BAD_AUTH))
async def test_bad_authorization_is_a_clean_4xx_and_never_logged(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    value: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    fake, root = await start(make_fake, make_gateway)
    answer = await post_raw(root, dumped(), auth=value)
    assert answer.status in (400, 401), answer.body
    err = openai_error(answer, answer.status)
    assert KEY not in answer.body.decode("utf-8", "replace")
    assert KEY[8:] not in err["message"]
    assert fake.fake.requests == []
    logged = "\n".join(
        r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
    )
    assert KEY[8:20] not in logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (await post_raw(root, dumped())).status == 200


async def test_expect_is_answered_before_the_body_is_sent(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A declared body over the limit is a 413 before "100 Continue" (the client was told to
    send it, then refused); an unknown expectation is a JSON 417 (plain text echoing it)."""
    up = await make_fake()
    gw = await make_gateway(policy(up.url, max_body_bytes=2048))

    async def head_only(*headers: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.root))
        writer.write(
            b"POST "
            + path
            + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Authorization: Bearer "
            + KEY.encode()
            + b"\r\n"
            + b"".join(headers)
            + b"\r\n"
        )
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        if first.startswith(b"HTTP/1.1 100"):
            writer.write(json.dumps(GOOD).encode())
        first += await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
        return first

    big = await head_only(b"Expect: 100-continue\r\n", b"Content-Length: 5000000\r\n")
    assert big.startswith(b"HTTP/1.1 413") and b"100 Continue" not in big
    odd = await head_only(b"Expect: 999-foo\r\n", b"Content-Length: 10\r\n")
    assert odd.startswith(b"HTTP/1.1 417") and b"application/json" in odd
    # on Anthropic's route, in Anthropic's format (curl sends Expect for bodies over 1 MiB)
    for expect, kind in (
        (b"100-continue", "request_too_large"),
        (b"999-foo", "invalid_request_error"),
    ):
        answer = await head_only(
            b"Expect: " + expect + b"\r\n", b"Content-Length: 5000000\r\n", path=b"/v1/messages"
        )
        head, raw = answer.split(b"\r\n\r\n", 1)
        body = json.loads(raw)
        assert body["type"] == "error" and body["error"]["type"] == kind
        # Its ids, as every other answer has them (before: none, given before the handler).
        assert b"\r\nx-request-id: " in head.lower() and b"\r\nrequest-id: " in head.lower()
    length = str(len(json.dumps(GOOD))).encode()
    fine = await head_only(b"Expect: 100-continue\r\n", b"Content-Length: " + length + b"\r\n")
    assert fine.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in fine
    assert up.fake.requests and len(up.fake.requests) == 1
