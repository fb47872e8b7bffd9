"""Tiered model aliases: route by difficulty, or cascade from the small tier to the large one.

Route mode scores the request before any model runs (``routing.difficulty``, on the request's
one embedding) and sends it to the small or the large tier by the policy's threshold.

Cascade mode runs the small tier first and holds its output until the commit point, where the
verifier (``routing.cascade``) keeps it or escalates. ``commit: {tokens: whole}`` asks the small
tier for a complete, non-streamed answer and judges all of it; ``commit: {tokens: N}`` streams
from the small tier, holds the first N content chunks, judges them, then either releases them
and relays the rest, or closes the small stream and serves the large tier alone. The client
never sees a token that is taken back. If the large tier then fails before its first byte, the
held small answer is served (``fallback_to_small``) with ``x-gateway-tier-fallback: small``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from aiohttp import web

from gateway.errors import GatewayError, Unavailable
from gateway.observability.metrics import GatewayMetrics
from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.protocol.sse import DONE, payloads
from gateway.runtime import Destination, Runtime
from gateway.stages.cache import QueryEmbedding
from gateway.upstream.attempts import Attempt, AttemptOpener, OpenRequest
from gateway.upstream.relay import RelayResult, StreamPlan, relay_body, relay_stream
from policies.models import TieredModelConfig
from routing.calibration import wants_large
from routing.cascade import CascadeVerdict, CascadeVerifier, SmallAnswer, load_verifier
from routing.difficulty import DifficultyEstimator, load_estimator


@cache
def _estimator(path: str | None) -> DifficultyEstimator:
    return load_estimator(path)


@cache
def _verifier() -> CascadeVerifier:
    return load_verifier()


@dataclass(frozen=True, slots=True)
class TierChoice:
    config: TieredModelConfig
    tier: int  # 0: small, 1: large
    score: float
    threshold: float
    targets: list[Destination]

    @property
    def name(self) -> str:
        return "large" if self.tier else "small"

    @property
    def cascade(self) -> bool:
        return self.config.mode == "cascade"


@dataclass(slots=True)
class CascadeOutcome:
    response: web.StreamResponse
    result: RelayResult
    attempt: Attempt
    verdict: CascadeVerdict | None


class TierStage:
    def __init__(self, opener: AttemptOpener, metrics: GatewayMetrics) -> None:
        self.opener = opener
        self.metrics = metrics

    async def choose(
        self,
        rt: Runtime,
        parsed: ParsedRequest,
        config: TieredModelConfig,
        query: QueryEmbedding,
    ) -> TierChoice:
        estimator = _estimator(config.artifact)
        vector = await query.get()
        score = 0.0
        if vector is not None and query.text:
            score = estimator.score(vector, query.text).score
        if config.mode == "cascade":
            return TierChoice(
                config, 0, score, _verifier().threshold, rt.tier_targets(parsed.model, config.small)
            )
        threshold = config.resolve_threshold(estimator)
        tier = 1 if wants_large(score, threshold) else 0
        self.metrics.tiers.labels(parsed.model, "route", "large" if tier else "small").inc()
        return TierChoice(
            config, tier, score, threshold, rt.tier_targets(parsed.model, config.tiers[tier])
        )

    async def cascade(
        self,
        request: web.Request,
        rt: Runtime,
        req: OpenRequest,
        choice: TierChoice,
        extra: dict[str, str],
    ) -> CascadeOutcome:
        config, parsed = choice.config, req.parsed
        verifier = _verifier()
        threshold = config.resolve_threshold(verifier)
        whole = config.commit_point.whole or not parsed.stream
        held: list[bytes] = []
        if whole:
            small_req = replace(req, parsed=_non_streaming(parsed))
            small = await self.opener.open(rt, small_req, choice.targets)
            body = await _read_all(small)
            answer = _answer_of(body, parsed.endpoint)
        else:
            small = await self.opener.open(rt, req, choice.targets)
            held, answer = await _hold(small, int(config.commit_point.tokens), parsed.endpoint)
        verdict = verifier.verdict(answer, choice.score, threshold)
        outcome = "escalated" if verdict.escalate else "kept"
        self.metrics.tiers.labels(parsed.model, "cascade", outcome).inc()
        extra = {**extra, "x-gateway-cascade": outcome}
        if not verdict.escalate:
            extra["x-gateway-tier"] = "small"
            if whole:
                small.guard.release()
                response, result = await _serve_answer(request, parsed, body, extra)
                return CascadeOutcome(response, result, small, verdict)
            plan = StreamPlan(first=b"".join(held), first_at=small.first_at)
            response, result = await relay_stream(request, small.response, extra, plan)
            return CascadeOutcome(response, result, small, verdict)
        # Escalate: the small answer is dropped (kept aside only as a fallback).
        if not whole:
            await small.discard()
        else:
            small.guard.release()
        started = time.perf_counter()
        try:
            large = await self.opener.open(rt, req, rt.tier_targets(parsed.model, config.large))
        except GatewayError:
            if not (config.fallback_to_small and whole and body):
                raise
            extra = {**extra, "x-gateway-tier": "small", "x-gateway-tier-fallback": "small"}
            response, result = await _serve_answer(request, parsed, body, extra)
            return CascadeOutcome(response, result, small, verdict)
        extra = {
            **extra,
            "x-gateway-tier": "large",
            "x-gateway-escalation-ms": f"{(time.perf_counter() - started) * 1000:.1f}",
        }
        return CascadeOutcome(*await _relay(request, parsed, large, extra), large, verdict)


def _non_streaming(parsed: ParsedRequest) -> ParsedRequest:
    body = {k: v for k, v in parsed.body.items() if k not in ("stream", "stream_options")}
    return ParsedRequest(parsed.endpoint, json.dumps(body).encode(), body, parsed.model, False)


async def _read_all(attempt: Attempt) -> bytes:
    try:
        body = await attempt.response.read()
    finally:
        attempt.response.release()
    if attempt.response.status != 200:
        attempt.guard.release()
        raise Unavailable(f"the small tier answered {attempt.response.status}", code="tier_failed")
    return body


def _answer_of(body: bytes, endpoint: Endpoint) -> SmallAnswer:
    try:
        data = json.loads(body)
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return SmallAnswer("", finish_reason="error")
    if endpoint is Endpoint.CHAT:
        text = (choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return SmallAnswer(text, _logprobs(choice), choice.get("finish_reason"))


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        content = lp.get("content")
        if isinstance(content, list):  # chat
            return [float(t["logprob"]) for t in content if isinstance(t, dict) and "logprob" in t]
        tokens = lp.get("token_logprobs")
        if isinstance(tokens, list):  # completions
            return [float(t) for t in tokens if isinstance(t, int | float)]
    return None


async def _hold(
    attempt: Attempt, tokens: int, endpoint: Endpoint
) -> tuple[list[bytes], SmallAnswer]:
    """Read the small stream until ``tokens`` content chunks (or its end); keep the bytes."""
    held = [attempt.first] if attempt.first else []
    buffer = b"".join(held)
    pieces: list[str] = []
    finish = None
    done = False

    def scan(events: Iterable[bytes]) -> None:
        nonlocal finish, done
        for event in events:
            for payload in payloads(event):
                if payload == DONE:
                    done = True
                    continue
                try:
                    choice = json.loads(payload)["choices"][0]
                except (ValueError, KeyError, IndexError, TypeError):
                    continue
                text = (
                    (choice.get("delta") or {}).get("content")
                    if endpoint is Endpoint.CHAT
                    else choice.get("text")
                )
                if text:
                    pieces.append(text)
                finish = choice.get("finish_reason") or finish

    *events, buffer = buffer.split(b"\n\n")
    scan(events)
    while not done and len(pieces) < tokens:
        data = await attempt.response.content.readany()
        if not data:
            break
        if attempt.first_at is None:
            attempt.first_at = time.perf_counter()
        held.append(data)
        *events, buffer = (buffer + data).split(b"\n\n")
        scan(events)
    answer = SmallAnswer("".join(pieces), None, finish, complete=done)
    return held, answer


async def _serve_answer(
    request: web.Request, parsed: ParsedRequest, body: bytes, extra: dict[str, str]
) -> tuple[web.StreamResponse, RelayResult]:
    """A held, complete answer: as JSON, or as SSE chunks when the client streams."""
    if not parsed.stream:
        whole = web.Response(body=body, content_type="application/json", headers=extra)
        return whole, RelayResult(200, body=body)
    resp = web.StreamResponse(
        headers={**extra, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    first_at = time.perf_counter()
    opts = parsed.body.get("stream_options")
    for chunk in json_to_sse(
        json.loads(body), isinstance(opts, dict) and bool(opts.get("include_usage"))
    ):
        await resp.write(chunk)
    await resp.write_eof()
    return resp, RelayResult(200, first_at=first_at, last_at=first_at, reads=1)


def json_to_sse(data: dict[str, Any], include_usage: bool) -> list[bytes]:
    chat = data.get("object") == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {k: data[k] for k in ("id", "created", "model") if k in data}
    out: list[bytes] = []

    def emit(payload: dict[str, Any]) -> None:
        out.append(b"data: " + json.dumps({**base, "object": obj, **payload}).encode() + b"\n\n")

    for choice in data.get("choices", []):
        index = choice.get("index", 0)
        if chat:
            message = choice.get("message") or {}
            delta = {k: v for k, v in message.items() if v is not None}
            emit({"choices": [{"index": index, "delta": delta, "finish_reason": None}]})
            emit(
                {
                    "choices": [
                        {"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}
                    ]
                }
            )
        else:
            emit(
                {
                    "choices": [
                        {
                            "index": index,
                            "text": choice.get("text", ""),
                            "finish_reason": choice.get("finish_reason"),
                        }
                    ]
                }
            )
    if include_usage and data.get("usage") is not None:
        emit({"choices": [], "usage": data["usage"]})
    out.append(b"data: [DONE]\n\n")
    return out


async def _relay(
    request: web.Request, parsed: ParsedRequest, attempt: Attempt, extra: dict[str, str]
) -> tuple[web.StreamResponse, RelayResult]:
    upstream = attempt.response
    if parsed.stream and upstream.status == 200:
        plan = StreamPlan(first=attempt.first, first_at=attempt.first_at)
        return await relay_stream(request, upstream, extra, plan)
    return await relay_body(upstream, extra)
