"""The fuzz corpus of bench.attacks: hostile requests by category, deterministic from a seed.

Each category holds the inputs that broke (or could break) a JSON-over-HTTP gateway: lone
surrogates, deep nesting, huge integers, duplicate keys, NaN/Infinity, UTF-16 and BOMs,
compressed bodies (valid, bombs, undecodable, unsupported), bad Authorization bytes, control
characters, random model names, wrong types, byte-level mutations of a valid body, odd paths.
Cases are drawn round-robin over the categories, and each category's variants in turn (their
parameters at random), so any count covers every category and variant in equal measure. Every key the corpus sends
contains SECRET, so a log line that carries one can be found afterwards.
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from bench._attack_http import build

MODEL = "attack-model"
SECRET = "fuzzsecret"  # in every key the fuzz sends: grep the gateway's log for it
CHAT = "/v1/chat/completions"

Case = tuple[str, bytes]  # (category, raw request)
T = TypeVar("T")


def _good_body(text: str = "hello", **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(extra)
    return body


def _gzip(data: bytes, level: int = 9) -> bytes:
    """gzip with a fixed header time, so the same seed gives the same bytes at any moment."""
    return gzip.compress(data, level, mtime=0)


class Corpus:
    def __init__(self, key: str, seed: int = 12) -> None:
        self.key = key.encode()
        self.rng = random.Random(seed)
        self._bombs: dict[tuple[str, int], bytes] = {}
        self._turns: dict[str, int] = {}

    def cycle(self, name: str, options: list[T]) -> T:
        """The next of ``options`` in turn (one turn counter per ``name``): every variant is sent."""
        turn = self._turns.get(name, 0)
        self._turns[name] = turn + 1
        return options[turn % len(options)]

    def auth(self) -> tuple[bytes, bytes]:
        return (b"Authorization", b"Bearer " + self.key)

    def post(
        self,
        raw_body: bytes,
        path: str = CHAT,
        extra: list[tuple[bytes, bytes]] | None = None,
        auth: bool = True,
        content_type: bytes = b"application/json",
    ) -> bytes:
        headers = [(b"Content-Type", content_type)]
        if auth:
            headers.append(self.auth())
        return build("POST", path, headers + (extra or []), raw_body)

    def json_post(self, body: object, **kw: object) -> bytes:
        return self.post(json.dumps(body).encode(), **kw)  # type: ignore[arg-type]

    # --- categories ---------------------------------------------------------------------

    def valid(self) -> bytes:
        n = self.rng.randrange(1_000_000)
        stream = self.rng.random() < 0.3
        return self.json_post(_good_body(f"question {n}", stream=stream))

    def surrogates(self) -> bytes:
        lone = self.rng.choice(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
        variants: list[Callable[[], bytes]] = [
            lambda: self.json_post(_good_body(model=lone)),
            lambda: self.json_post(_good_body(lone)),  # message text: the cache key path
            lambda: self.json_post(_good_body(lone, stream=True)),
            lambda: self.json_post(
                {"model": MODEL, "messages": [{"role": lone, "content": "x"}]}
            ),
            lambda: self.json_post({"model": MODEL, "prompt": lone}, path="/v1/completions"),
            lambda: self.json_post({"model": MODEL, "input": lone}, path="/v1/embeddings"),
            lambda: self.json_post(_good_body(user=lone, stop=[lone])),
            # raw bytes that are not UTF-8: an encoded surrogate, a lone continuation, 0xff
            lambda: self.post(
                json.dumps(_good_body("XX")).encode().replace(b"XX", self.rng.choice(
                    [b"\xed\xa0\x80", b"\x80", b"\xff\xfe", b"\xc3"]
                ))
            ),
        ]  # fmt: skip
        return self.cycle("surrogates", variants)()

    def deep(self) -> bytes:
        depth = self.rng.choice([200, 1_000, 5_000, 100_000])
        nested = "[" * depth + "]" * depth
        where = self.rng.choice(["content", "top", "extra", "object"])
        if where == "content":
            raw = json.dumps(_good_body("@@")).replace('"@@"', nested)
        elif where == "top":
            raw = nested
        elif where == "extra":
            raw = json.dumps(_good_body(vendor_extra="@@")).replace('"@@"', nested)
        else:
            raw = json.dumps(_good_body(metadata="@@")).replace(
                '"@@"', '{"a":' * depth + "1" + "}" * depth
            )
        return self.post(raw.encode())

    def huge_int(self) -> bytes:
        digits = self.rng.choice([4_301, 10_000, 200_000])
        number = "9" * digits
        field = self.rng.choice(["max_tokens", "n", "seed", "temperature", "top_logprobs"])
        raw = json.dumps(_good_body("big", **{field: 1})).replace(
            f'"{field}": 1', f'"{field}": {number}'
        )
        if self.rng.random() < 0.3:
            raw = raw.replace(number, "1e" + number[:6])  # a float that overflows to inf
        return self.post(raw.encode())

    def duplicate_keys(self) -> bytes:
        msg = '[{"role": "user", "content": "x"}]'
        raw = self.cycle("duplicate_keys", [
            f'{{"model": "{MODEL}", "model": "other", "messages": {msg}}}',
            f'{{"model": "{MODEL}", "messages": [], "messages": {msg}}}',
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", "content": "y"}}]}}',
            f'{{"model": "{MODEL}", "stream": false, "stream": true, "messages": {msg}}}',
            f'{{"model": "{MODEL}", "max_tokens": 1, "max_tokens": 100000, "messages": {msg}}}',
        ])  # fmt: skip
        return self.post(raw.encode())

    def nan(self) -> bytes:
        token = self.rng.choice(["NaN", "Infinity", "-Infinity"])
        field = self.rng.choice(["temperature", "top_p", "max_tokens", "presence_penalty"])
        raw = json.dumps(_good_body("nan", **{field: 0.5})).replace(
            f'"{field}": 0.5', f'"{field}": {token}'
        )
        return self.post(raw.encode())

    def utf16(self) -> bytes:
        text = json.dumps(_good_body("bom"))
        encoded = self.cycle("utf16", [
            text.encode("utf-16"), text.encode("utf-16-le"), text.encode("utf-16-be"),
            b"\xef\xbb\xbf" + text.encode(), text.encode("utf-32"),
        ])  # fmt: skip
        ctype = self.rng.choice([b"application/json", b"application/json; charset=utf-16"])
        return self.post(encoded, content_type=ctype)

    def _bomb(self, encoding: str, size: int) -> bytes:
        if (encoding, size) not in self._bombs:
            payload = b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
            payload += b"a" * size + b'"}]}'
            squeezed = _gzip(payload, 9) if encoding == "gzip" else zlib.compress(payload, 9)
            self._bombs[(encoding, size)] = squeezed
        return self._bombs[(encoding, size)]

    def encoded(self) -> bytes:
        body = json.dumps(_good_body(f"zipped {self.rng.randrange(10**6)}")).encode()
        kind = self.cycle("encoded", ["gzip", "deflate", "bomb", "bomb", "junk", "truncated",
                                "unsupported", "stacked"])  # fmt: skip
        if kind == "gzip":
            data, enc = _gzip(body), b"gzip"
        elif kind == "deflate":
            data, enc = zlib.compress(body), b"deflate"
        elif kind == "bomb":
            enc_name = self.rng.choice(["gzip", "deflate"])
            data, enc = self._bomb(enc_name, 16 << 20), enc_name.encode()
        elif kind == "junk":
            data, enc = self.rng.randbytes(512), self.rng.choice([b"gzip", b"deflate"])
        elif kind == "truncated":
            data, enc = _gzip(body)[:-12], b"gzip"
        elif kind == "unsupported":
            data, enc = body, self.rng.choice([b"br", b"zstd", b"x-evil", b"compress"])
        else:
            data, enc = _gzip(_gzip(body)), b"gzip, gzip"
        return self.post(data, extra=[(b"Content-Encoding", enc)])

    def bad_auth(self) -> bytes:
        secret = SECRET.encode()
        value = self.cycle("bad_auth", [
            b"Bearer \xff\xfe" + secret, b"Bearer sk-\x01" + secret, b"Bearer " + secret + b"\x7f",
            b"Bearer " + secret * 1000, b"Bearer " + b"A" * 9000 + secret,
            b"Bearer \xd0\xba\xd0\xbb" + secret, b"Basic " + secret, b"Bearer", b"",
            b"Bearer  " + self.key, b"Bearer " + self.key + b" ", b"bearer " + secret,
            b"Bearer " + secret + b"\x00",
        ])  # fmt: skip
        body = json.dumps(_good_body("auth")).encode()
        headers = [(b"Content-Type", b"application/json"), (b"Authorization", value)]
        path = self.rng.choice([CHAT, CHAT, "/v1/models", "/v1/models/" + MODEL])
        if path == CHAT:
            return build("POST", path, headers, body)
        return build("GET", path, headers)

    def control_chars(self) -> bytes:
        ctl = bytes([self.rng.choice([0x00, 0x01, 0x07, 0x0B, 0x1B, 0x7F, 0x85])])
        variants: list[Callable[[], bytes]] = [
            lambda: self.post(json.dumps(_good_body("x")).encode(), extra=[(b"X-Request-Id", b"id" + ctl)]),
            lambda: self.post(json.dumps(_good_body("x")).encode(), extra=[(b"X-Surface", b"s" + ctl)]),
            lambda: self.post(json.dumps(_good_body("x")).encode(), extra=[(b"X-Session-Id", ctl * 10)]),
            lambda: self.post(json.dumps(_good_body("x")).encode(), extra=[(b"traceparent", b"00-" + ctl)]),
            lambda: self.json_post(_good_body("a\u0000b\u001bc\u2028")),
            lambda: self.json_post(_good_body(model=MODEL + "\u0000")),
            lambda: self.post(json.dumps(_good_body("x")).encode().replace(b'"x"', b'"' + ctl + b'"')),
        ]  # fmt: skip
        return self.cycle("control_chars", variants)()

    def model_name(self) -> bytes:
        alphabet = "abcxyz0189-_./:@ \u00e9\u4e2d\U0001f600%\\\"'<>{}"
        name = "".join(self.rng.choice(alphabet) for _ in range(self.rng.randrange(1, 40)))
        if self.rng.random() < 0.1:
            name = name * 300  # a long name
        path = self.rng.choice([CHAT, CHAT, "/v1/completions", "/v1/embeddings"])
        body: dict[str, object] = _good_body("m", model=name)
        if path != CHAT:
            body = {"model": name, "prompt": "m", "input": "m"}
        return self.json_post(body, path=path)

    def wrong_types(self) -> bytes:
        good = _good_body("types")
        field, value = self.cycle("wrong_types", [
            ("messages", "hello"), ("messages", 5), ("messages", None), ("messages", [1]),
            ("messages", [{"role": 5, "content": "x"}]), ("messages", [{"content": "x"}]),
            ("messages", [{"role": "user", "content": 5}]), ("messages", [{"role": "user", "content": {"a": 1}}]),
            ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]), ("messages", []),
            ("max_tokens", "10"), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
            ("stream", "yes"), ("stream", 1), ("temperature", "hot"), ("n", "2"), ("n", -1), ("model", 5),
            ("model", None), ("model", []), ("model", {}), ("stop", 5), ("tools", "x"),
            ("stream_options", "x"), ("response_format", 7), ("user", 12), ("logit_bias", [1]),
        ])  # fmt: skip
        good[field] = value
        whole = self.rng.random()
        if whole < 0.1:
            return self.post(self.rng.choice([b"[]", b'"s"', b"1", b"null", b"", b"{", b"{}"]))
        if whole < 0.15:
            return self.post(json.dumps(good).encode(), content_type=b"text/plain")
        if whole < 0.25:
            other = {"model": MODEL, "prompt": value, "input": value}
            return self.json_post(
                other, path=self.rng.choice(["/v1/completions", "/v1/embeddings"])
            )
        return self.json_post(good)

    def mutated(self) -> bytes:
        raw = bytearray(json.dumps(_good_body(f"mutate {self.rng.randrange(10**6)}")).encode())
        for _ in range(self.rng.randrange(1, 6)):
            op = self.rng.randrange(3)
            at = self.rng.randrange(len(raw))
            if op == 0:
                raw[at] = self.rng.randrange(256)
            elif op == 1:
                del raw[at : at + self.rng.randrange(1, 8)]
            else:
                raw[at:at] = self.rng.randbytes(self.rng.randrange(1, 8))
        return self.post(bytes(raw))

    def odd_paths(self) -> bytes:
        path, method = self.cycle("odd_paths", [
            ("/v1/chat/completions", "GET"), ("/v1/models/\ud800".encode("utf-8", "surrogatepass").decode("latin-1"), "GET"),
            ("/v1/models/%ff%fe", "GET"), ("/v1/models/" + "a" * 10_000, "GET"), ("/v1/%00", "POST"),
            ("/admin/cache", "DELETE"), ("/admin/reload", "GET"), ("/v1/chat/completions?x=\x01", "POST"),
            ("/../../etc/passwd", "GET"), ("/metrics?format=%zz", "GET"), ("/readyz", "POST"),
        ])  # fmt: skip
        headers = [self.auth(), (b"Content-Type", b"application/json")]
        return build(method, path, headers, json.dumps(_good_body("p")).encode())


CATEGORIES = (
    "valid", "surrogates", "deep", "huge_int", "duplicate_keys", "nan", "utf16", "encoded",
    "bad_auth", "control_chars", "model_name", "wrong_types", "mutated", "odd_paths",
)  # fmt: skip


def cases(key: str, count: int, seed: int = 12) -> Iterator[Case]:
    """``count`` cases, round-robin over the categories."""
    corpus = Corpus(key, seed)
    for i in range(count):
        category = CATEGORIES[i % len(CATEGORIES)]
        try:
            raw = getattr(corpus, category)()
        except UnicodeEncodeError:  # a path the generator cannot spell as bytes: skip it
            raw = corpus.valid()
        yield category, raw
