"""Upstream answers a gateway must survive: JSON strings that are not valid Unicode (lone
surrogates, written as ``\\ud800`` escapes, which ``json.loads`` accepts) through every surface,
token counts past belief, and integers past what OTLP's int64 holds, as a caller's ``seed``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families

from gateway import dialects
from gateway.observability.log_every import LogEvery
from gateway.observability.otlp import Exporter
from gateway.observability.otlp_encoding import Encoder
from gateway.observability.tracing import Telemetry
from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, serve, vllm
from tests.e2e.limits_helpers import KEYS, limits_policy, metric

ODD = "\\ud800"  # as the upstream's bytes spell it: a JSON escape of a lone surrogate
USUAL_USAGE = '{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}'


def _odd(payload: dict[str, Any], usage: str) -> str:
    """``payload`` as JSON with each ``@`` written as a lone surrogate's escape and ``usage``'s
    text where the payload says ``"USAGE"``."""
    return json.dumps(payload).replace("@", ODD).replace('"USAGE"', usage)


def _answer(stream: bool, usage: str) -> list[bytes]:
    head = {"id": "cmpl-@", "created": 1, "model": "fake-@"}
    if not stream:
        message = {"role": "assistant", "content": "a@b"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        answer = {**head, "object": "chat.completion", "choices": [choice], "usage": "USAGE"}
        return [_odd(answer, usage).encode()]
    chunk = {**head, "object": "chat.completion.chunk"}
    deltas = [({"role": "assistant", "content": "a@"}, None), ({"content": "b"}, "stop")]
    events = [
        {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        for delta, finish in deltas
    ]
    events.append({**chunk, "choices": [], "usage": "USAGE"})
    return [f"data: {_odd(e, usage)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


@dataclass
class OddUpstream:
    url: str
    usage: str = USUAL_USAGE  # the usage object's JSON text in every answer
    raw: str | None = None  # else the whole answer (streamed: one chunk between good ones)


GOOD_CHUNKS = [
    {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]},
    {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
]  # fmt: skip


def _raw_answer(stream: bool, raw: str) -> list[bytes]:
    if not stream:
        return [raw.encode()]
    first, last = (f"data: {json.dumps(c)}\n\n".encode() for c in GOOD_CHUNKS)
    return [first, f"data: {raw}\n\n".encode(), last, b"data: [DONE]\n\n"]


@pytest.fixture
async def odd_upstream() -> AsyncIterator[OddUpstream]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stream = bool(body.get("stream"))
        if upstream.raw is None:
            pieces = _answer(stream, upstream.usage)
        else:
            pieces = _raw_answer(stream, upstream.raw)
        if not stream:
            return web.Response(body=pieces[0], content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", health)
    runner, url = await serve(app)
    upstream = OddUpstream(url)
    yield upstream
    await runner.cleanup()


class Collector:
    """An OTLP exporter's delivery that decodes each batch as a collector would."""

    def __init__(self) -> None:
        self.encoder = Encoder({"service.name": "test"})
        self.spans: list[Span] = []

    def deliver(self, encoded: list[bytes]) -> None:
        message = ExportTraceServiceRequest()
        message.ParseFromString(self.encoder.request(encoded))  # raises on a corrupt batch
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)

    def telemetry(self) -> tuple[Telemetry, Exporter]:
        exporter = Exporter(self.deliver, prepare=self.encoder.span)
        return Telemetry(exporter, exporter=exporter), exporter


# (path, body, how a whole streamed answer ends)
CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "data: [DONE]"),
    ("/v1/responses", {"input": "hi"}, '"type":"response.completed"'),
    (
        "/v1/messages",
        {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
        '"type":"message_stop"',
    ),
]


@pytest.mark.parametrize("cached", [False, True])
async def test_lone_surrogates_from_upstream_never_break_a_surface(
    odd_upstream: OddUpstream, make_gateway: GatewayFactory, cached: bool
) -> None:
    """Each surface answers whole, streamed or not, live and (when cached) from the cache, and
    every span is exported."""
    collector = Collector()
    telemetry, exporter = collector.telemetry()
    surfaces = {"default": {"cache": {"exact": True}}} if cached else {}
    policy = pool_policy([odd_upstream.url], surfaces=surfaces)
    gw = await make_gateway(policy, telemetry=telemetry)
    served: list[str] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # the second round is served from the cache when it is on
            for path, body, end in CALLS:
                for stream in (False, True):
                    async with session.post(
                        gw.root + path,
                        json={"model": "m", "stream": stream, "temperature": 0, **body},
                    ) as r:
                        text = await r.text()
                        assert r.status == 200, (path, stream, text)
                        assert "a\\ud800" in text, text  # the escape, passed on as it came
                        if stream:
                            assert end in text, text
                        else:
                            json.loads(text)
                        served.append(r.headers.get("x-gateway-cache", ""))
            if cached:
                await gw.runtime.cache.drain()  # type: ignore[union-attr]
        async with session.get(gw.root + "/metrics") as r:
            assert r.status == 200
    assert exporter.force_flush()
    assert exporter.dropped == 0
    assert exporter.exported == len(collector.spans) >= 2 * len(served)  # a request's, an attempt's
    if cached:
        assert served[len(CALLS) * 2 :] == ["exact"] * (len(CALLS) * 2)


# Counts no answer can have used: past MAX_TOKENS (10**9), past int64, past a double.
BEYOND = ["10" + "0" * 29, "9223372036854775808", "9" * 400]


@pytest.mark.parametrize("with_redis", [False, True])
async def test_usage_past_belief_is_charged_as_estimated(
    odd_upstream: OddUpstream,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    with_redis: bool,
) -> None:
    """An answer reporting more tokens than any answer can use is answered, and charged the
    request's estimate (not the count, which would overflow the counters and the limit store's
    exact range); /metrics keeps answering."""
    rules = {"limits": {"tokens_per_minute": 1_000_000}, "budget": {"usd": 5, "window": "day"}}
    redis_url = redis_server.url if with_redis else None
    gw = await make_gateway(limits_policy(odd_upstream.url, redis_url, rules))
    headers = {"Authorization": "Bearer " + KEYS["team-a"]}
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with aiohttp.ClientSession(headers=headers) as session:
        for count in BEYOND:
            odd_upstream.usage = f'{{"prompt_tokens": 3, "completion_tokens": {count}}}'
            for stream in (False, True):
                async with session.post(
                    gw.base_url + "/chat/completions", json={**request, "stream": stream}
                ) as r:
                    assert r.status == 200, await r.text()
                    text = await r.text()
                    # Non-streamed, the answer as sent; streamed, the usage chunk the client
                    # did not ask for is taken out, readable or not.
                    assert (count in text) != stream, text
                await gw.runtime.limiter.drain()
        async with session.get(gw.root + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    tokens = {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "llm_gateway_tokens"
        for sample in family.samples
        if sample.name == "llm_gateway_tokens_total"
    }
    # Six answers, each charged its estimate: at most max_tokens of output.
    assert 0 < tokens["output"] <= 6 * 16, tokens


async def test_a_seed_past_int64_keeps_the_trace_batch_valid(
    odd_upstream: OddUpstream, make_gateway: GatewayFactory
) -> None:
    """OTLP's int_value is an int64: a caller's integer beyond it is sent as a string, not as a
    varint that corrupts the batch (every tenant's spans in it)."""
    collector = Collector()
    telemetry, exporter = collector.telemetry()
    gw = await make_gateway(pool_policy([odd_upstream.url]), telemetry=telemetry)
    seeds = ["1" + "0" * 30, "-" + "9" * 25, "9223372036854775807"]
    async with aiohttp.ClientSession() as session:
        for seed in seeds:
            body = '{"model": "m", "seed": %s, "messages": [{"role": "user", "content": "x"}]}'
            async with session.post(
                gw.base_url + "/chat/completions",
                data=(body % seed).encode(),
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 200, await r.text()
    assert exporter.force_flush()
    assert exporter.dropped == 0
    sent = [
        attribute.value
        for span in collector.spans
        for attribute in span.attributes
        if attribute.key == "gen_ai.request.seed"
    ]
    assert [v.string_value for v in sent[:2]] == seeds[:2]
    assert sent[2].int_value == 2**63 - 1


def each_answer(answers: list[str], chunks: list[str]) -> pytest.MarkDecorator:
    """Run once per whole answer (``stream`` False) and once per stream chunk (True)."""
    return pytest.mark.parametrize(
        ("stream", "raw"),
        [(False, a) for a in answers] + [(True, c) for c in chunks],
        ids=[f"answer{i}" for i in range(len(answers))] + [f"chunk{i}" for i in range(len(chunks))],
    )


DEEP = "[" * 9999 + "]" * 9999
# Answers of the right status and the wrong shapes: a list or a number where an object or a
# list belongs, an unhashable finish reason, negative counts.
MISSHAPEN_ANSWERS = [
    '{"choices": [{"message": {"content": "x", "tool_calls": "bad"}}]}',
    '{"choices": [{"message": {"tool_calls": 5}}]}',
    '{"choices": [{"message": {"tool_calls": [{"function": "x"}, 7, null]}}]}',
    '{"choices": [{"message": {"content": "x"}, "finish_reason": ["length"]}]}',
    '{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"top_logprobs": 5}]}}]}',
    '{"choices": 5, "usage": {"prompt_tokens": -4, "completion_tokens": 2}}',
    '{"choices": [null, "x"], "usage": 7, "created": "x", "model": []}',
    # Nesting deeper than json.loads's stack: valid JSON, which it fails with a RecursionError.
    '{"choices": [{"message": {"content": "x"}}], "deep": ' + DEEP + "}",
    '{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"bytes": '
    + DEEP
    + "}]}}]}",
    '{"choices": [{"message": {"tool_calls": [{"function": {"arguments": "'
    + DEEP[:9999]
    + '"}}]}}]}',
]
MISSHAPEN_CHUNKS = [
    '{"choices": 5}',
    '{"choices": [{"delta": {"tool_calls": 5}}]}',
    '{"choices": [{"delta": {"tool_calls": [{"index": 0, "function": "x"}, 3]}}]}',
    '{"choices": [{"delta": {}, "finish_reason": ["x"]}]}',
    '{"choices": [{"delta": {"content": "x"}, "logprobs": {"content": [{"top_logprobs": 5}]}}]}',
    '{"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": "x"}}',
    '{"choices": [{"delta": {"content": "x"}}], "deep": ' + DEEP + "}",
]


@each_answer(MISSHAPEN_ANSWERS, MISSHAPEN_CHUNKS)
async def test_misshapen_answers_are_re_told_or_refused_never_a_500(
    odd_upstream: OddUpstream,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    raw: str,
) -> None:
    """Through each API: a whole answer is re-told or refused with a 502 in the caller's
    format; a stream reaches its final event (or its API's error event), never cut off by an
    error of the gateway's own. Counts the client reads are never negative."""
    odd_upstream.raw = raw
    gw = await make_gateway(pool_policy([odd_upstream.url]))
    async with aiohttp.ClientSession() as session:
        for path, body, end in CALLS:
            async with session.post(
                gw.root + path, json={"model": "m", "stream": stream, **body}
            ) as r:
                text = await r.text()
            assert r.status in (200, 502), (path, r.status, text)
            assert '_tokens": -' not in text or path.endswith("completions"), text
            if r.status == 502:
                assert "could not be read" in text, text
            elif stream:
                assert end in text or '"type":"error"' in text or "response.failed" in text, text
            elif path.endswith("completions"):
                assert text == raw  # chat answers pass on as they came
            else:
                assert isinstance(json.loads(text), dict)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_answer_its_api_cannot_tell_is_a_502_in_every_count(
    odd_upstream: OddUpstream, make_gateway: GatewayFactory
) -> None:
    """A whole chat answer the Messages or Responses API cannot tell (nested past what JSON
    parsing takes) is the 502 its client reads in every count too: the request's metric, the
    attempt's outcome (bad_answer) and the replica's health, with no cost said. It was counted
    a 200 served by a replica that did well."""
    answer = json.loads(_answer(False, USUAL_USAGE)[0].replace(ODD.encode(), b"x"))
    odd_upstream.raw = json.dumps(answer)[:-1] + ', "x": ' + DEEP + "}"
    price = {"input_per_mtok": 1, "output_per_mtok": 2}
    backends = {"up": vllm(odd_upstream.url, health={"eject_after": 2})}
    gw = await make_gateway(build_policy(backends, {"m": {"backend": "up", "price": price}}))
    async with anthropic.AsyncAnthropic(
        base_url=gw.root, api_key="unused", max_retries=0, timeout=20
    ) as claude:
        with pytest.raises(anthropic.InternalServerError) as messages:
            await claude.messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
    with pytest.raises(openai.InternalServerError) as responses:
        await gw.client.responses.create(model="m", input="hi")
    for refused in (messages.value, responses.value):
        assert refused.status_code == 502 and "could not be read" in refused.message
        assert "x-gateway-cost-usd" not in refused.response.headers
    assert await metric([gw], "llm_gateway_requests_total", status="502") == 2
    assert await metric([gw], "llm_gateway_requests_total", status="200") == 0
    assert await metric([gw], "llm_gateway_upstream_attempts_total", outcome="bad_answer") == 2
    assert await metric([gw], "llm_gateway_upstream_attempts_total", outcome="ok") == 0
    assert not gw.runtime.pools["up"].replicas[0].healthy  # two failed answers: ejected


SMALL_TIER_ANSWERS = [
    *MISSHAPEN_ANSWERS,
    '{"choices": ["x"]}',
    '{"choices": [{"message": "x"}]}',
    '{"choices": [{"message": {"content": 5}, "finish_reason": 3}]}',
    '{"choices": [{"message": {"content": "12"}, "logprobs": {"content": [{"logprob": "x"},'
    ' {"logprob": null}, {"logprob": ' + "9" * 400 + "}]}}]}",
]


@each_answer(SMALL_TIER_ANSWERS, MISSHAPEN_CHUNKS)
async def test_a_cascade_judges_a_misshapen_small_answer_never_a_500(
    odd_upstream: OddUpstream,
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    raw: str,
) -> None:
    """The small tier's answer (whole, or its stream held to a commit point) is judged, kept or
    escalated; a shape it cannot read never fails the request."""
    odd_upstream.raw = raw
    large = await make_fake(reply="large")
    commit = {"tokens": 4} if stream else {"tokens": "whole"}
    tiers = {"tiers": ["small", "large"], "mode": "cascade", "commit": commit}
    backends = {"small": vllm(odd_upstream.url), "large": vllm(large.url)}
    gw = await make_gateway(build_policy(backends, {"auto": tiers}))
    async with aiohttp.ClientSession() as session:
        body = {"model": "auto", "stream": stream, "messages": [{"role": "user", "content": "2+2"}]}
        async with session.post(gw.base_url + "/chat/completions", json=body) as r:
            text = await r.text()
    assert r.status == 200, text
    assert r.headers["x-gateway-tier"] in ("small", "large")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


CACHE_ANSWERS = [
    *MISSHAPEN_ANSWERS,
    '{"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",'
    ' "message": {"role": "assistant", "content": 5}}]}',
]
CACHE_CHUNKS = [  # those whose text or tool calls cannot be read (an odd usage, a finish
    # reason a later chunk replaces, odd logprobs: replayed as they came, harmlessly)
    *MISSHAPEN_CHUNKS[:3],
    '{"choices": [{"index": 0, "delta": {"content": 5}}]}',
    '{"choices": [{"index": "a", "delta": {"tool_calls": [{"index": 0, "function": 5}]}}]}',
]


@each_answer(CACHE_ANSWERS, CACHE_CHUNKS)
async def test_a_misshapen_answer_is_never_stored_in_the_cache(
    odd_upstream: OddUpstream,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    raw: str,
) -> None:
    """Answered as it came, never stored: the same question goes upstream again."""
    odd_upstream.raw = raw
    surfaces = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(pool_policy([odd_upstream.url], surfaces=surfaces))
    seen = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            body = {"model": "m", "stream": stream, "temperature": 0,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            async with session.post(gw.base_url + "/chat/completions", json=body) as r:
                await r.read()
                seen.append((r.status, r.headers.get("x-gateway-cache")))
            await gw.runtime.cache.drain()  # type: ignore[union-attr]
    assert seen == [(200, "miss"), (200, "miss")]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


ERRORS_TOLD_WITH_200 = [
    '{"error": {"message": "hidden error in 200", "type": "server_error"}}',
    '{"type": "error", "error": {"type": "overloaded_error", "message": "hidden"}}',
    '{"error": "hidden error in 200"}',
]


@pytest.mark.parametrize("raw", ERRORS_TOLD_WITH_200)
async def test_an_error_told_with_a_200_is_a_502_in_each_api(
    odd_upstream: OddUpstream, make_gateway: GatewayFactory, raw: str
) -> None:
    """A provider or proxy that answers its failure with a 200: a 502 in the caller's format,
    the replica's ``bad_answer``, never a stored empty answer (it was a 200 relayed as it came
    on chat, an empty completed Response, a Message with no content)."""
    odd_upstream.raw = raw
    surfaces = {"default": {"cache": {"exact": True}}}
    gw = await make_gateway(pool_policy([odd_upstream.url], surfaces=surfaces))
    async with aiohttp.ClientSession() as session:
        for path, body, _ in CALLS:
            async with session.post(gw.root + path, json={"model": "m", **body}) as r:
                answer = await r.json()
            assert r.status == 502, (path, answer)
            kind = answer["error"]["type"]
            assert kind == ("api_error" if path == "/v1/messages" else "upstream_error"), answer
            assert "hidden" not in json.dumps(answer)
    assert await metric([gw], "llm_gateway_upstream_attempts_total", outcome="bad_answer") == 3
    assert await metric([gw], "llm_gateway_requests_total", status="200") == 0


async def test_answers_that_cannot_be_re_told_are_logged_once_per_kind_and_period(
    odd_upstream: OddUpstream,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upstream that sends one answer the Messages API cannot tell sends them all: a line
    per request buried the log (as the relay's own failures did); one per kind every 10 s."""
    monkeypatch.setattr(dialects, "_unreadable", LogEvery(dialects.log))
    answer = json.loads(_answer(False, USUAL_USAGE)[0].replace(ODD.encode(), b"x"))
    odd_upstream.raw = json.dumps(answer)[:-1] + ', "x": ' + DEEP + "}"
    gw = await make_gateway(pool_policy([odd_upstream.url]))
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    statuses = []
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            async with session.post(gw.root + "/v1/messages", json=body) as r:
                statuses.append(r.status)  # 529 once the replica is ejected for its answers
    assert statuses.count(502) >= 2 and set(statuses) <= {502, 529}
    told = [r for r in caplog.records if "could not be re-told" in r.getMessage()]
    assert len(told) == 1
