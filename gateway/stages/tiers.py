"""The tier stage: route a tiered alias by difficulty, or cascade from the small tier up.

Route mode scores the request before any model runs (``routing.difficulty``, on the user's
text and its one embedding) and sends it to the small or the large tier by the policy's
threshold.

Cascade mode runs the small tier first and holds its output until the commit point, where the
verifier (``routing.cascade``) keeps it or escalates. ``commit: {tokens: whole}`` asks the small
tier for a complete, non-streamed answer and judges all of it; ``commit: {tokens: N}`` streams
from the small tier, holds the first N content chunks, judges them, then either hands the
attempt (held chunks first) to the relay, or closes the small stream and opens the large tier.
The client never sees a token that is taken back. If the large tier then fails before its
first byte, the small answer read whole is served (``fallback_to_small``) with
``x-gateway-tier-fallback: small`` (a held stream was closed: nothing is left to serve).
The stage judges (``judge``) and then answers (``answer``) in two steps, so the orchestrator
counts the verdict and pays for an escalated small answer before the large tier is asked. If the small tier fails (no replica can answer, it answers
4xx, its answer breaks off, goes silent for ``idle_s`` or is not JSON), the large tier answers:
a failed small tier is one more reason to escalate, never the request's failure while the
caller's deadline lasts. A replica to blame (broken, silent, not JSON) has it counted against
its health, as the relay does for the answers it reads.

Whatever the outcome, what goes back to the client is a live attempt or a finished answer that
the orchestrator sends through the one relay path (deadline, metrics, span summary and cache
capture included). Reading the held part respects the surface's deadline too: when it passes
while holding, the small answer is kept and the relay ends it at once.

The artifacts a policy names are loaded when the runtime is built, so a missing or invalid
file is a policy error (``llm-gateway check``, reloads) and never a failed request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from gateway.call import Call
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.limits.cost import Price, Usage
from gateway.protocol import upstream_json
from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.protocol.sse import DONE, EventSplitter, EventTooLong, Framing, payloads
from gateway.runtime import Destination
from gateway.upstream.attempt import Attempt
from gateway.upstream.attempts import AttemptOpener
from gateway.upstream.whole_answer import read_whole
from policies.models import TieredModelConfig
from routing.calibration import wants_large
from routing.cascade import CascadeVerdict, CascadeVerifier, SmallAnswer
from routing.difficulty import DifficultyEstimator

CLOCK_SLACK_S = 0.005


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

    def headers(self) -> dict[str, str]:
        return {"x-gateway-tier": self.name, "x-gateway-difficulty": f"{self.score:.4f}"}


@dataclass(slots=True)
class Judged:
    """The small tier's answer at the commit point and what is decided on it."""

    verdict: CascadeVerdict
    escalate: bool  # the verdict's, unless the caller's deadline is spent (then kept)
    small: Attempt | None  # None: the small tier failed
    whole: bool  # the small answer was asked for whole (else: a stream held to N chunks)
    body: bytes | None = None  # the small answer, when read whole
    paid: Usage | None = None  # its usage, when read whole and reported
    # Wall clock (ns) of the verdict: where an escalated small answer's span ends (``lost``).
    judged_at: int = field(default_factory=time.time_ns)

    def discarded(self) -> tuple[Usage, Price | None] | None:
        """What an escalation throws away after paying for it: the small answer read whole."""
        if not self.escalate or self.paid is None or self.small is None:
            return None
        return self.paid, self.small.target.price


@dataclass(slots=True)
class Cascaded:
    """A cascade's outcome: the attempt to relay, or a finished answer to send (``held``)."""

    attempt: Attempt
    held: bytes | None
    headers: dict[str, str]
    fallback: bool = False  # escalated, the large tier failed: the held small answer is served


class TierStage:
    def __init__(
        self,
        estimators: Mapping[str | None, DifficultyEstimator],
        verifiers: Mapping[str | None, CascadeVerifier],
    ) -> None:
        # By the artifact path a tiered alias names (None: the one shipped in the package).
        self.estimators = estimators
        self.verifiers = verifiers

    async def choose(self, call: Call, config: TieredModelConfig) -> TierChoice:
        estimator = self.estimators[config.artifact]
        vector = await call.query.vector()
        score = 0.0
        if vector is not None and call.query.text:
            score = estimator.score(vector, call.query.text).score
        rt, alias = call.rt, call.parsed.model
        if config.mode == "cascade":
            threshold = config.resolve_threshold(self.verifiers[config.artifact])
            return TierChoice(config, 0, score, threshold, rt.tier_targets(alias, config.small))
        threshold = config.resolve_threshold(estimator)
        tier = 1 if wants_large(score, threshold) else 0
        return TierChoice(
            config, tier, score, threshold, rt.tier_targets(alias, config.tiers[tier])
        )

    async def judge(self, call: Call, choice: TierChoice, opener: AttemptOpener) -> Judged:
        """The small tier's answer, held to the commit point, and the verifier's verdict on it."""
        config, parsed = choice.config, call.parsed
        whole = config.commit_point.whole or not parsed.stream
        body: bytes | None = None
        paid: Usage | None = None  # the small answer's usage, when it is read whole
        small: Attempt | None = None
        try:
            if whole:
                request = replace(call, parsed=_non_streaming(parsed))
                small = await opener.open(request, choice.targets)
                limit = call.rt.policy.server.max_response_bytes
                body, data = await _read_all(small, call.deadline, limit)
                answer, paid = _answer_of(data, parsed.endpoint)
            else:
                small = await opener.open(call, choice.targets)
                if small.response.status != 200:  # a 4xx: the large tier's own answer is asked
                    _failed(small)
                    raise UpstreamError(
                        f"the small tier answered {small.response.status}", code="tier_failed"
                    )
                answer = await _hold(small, int(config.commit_point.tokens), parsed.endpoint, call)
        except GatewayError as exc:
            # The small tier failed (no replica, an error, a broken or unreadable answer, a 4xx
            # it gave): the large tier answers, unless the caller's deadline is already spent
            # (then nothing reached the client: a 504, as a plain request's before its first byte).
            if _past(call.deadline):
                raise
            verdict = CascadeVerdict(True, 0.0, choice.threshold, f"escalate: {exc.message}")
            return Judged(verdict, True, None, whole)
        if answer.finish_reason == "length" and _callers_limit(parsed.body, small.capped):
            answer = replace(answer, callers_limit=True)
        verdict = self.verifiers[config.artifact].verdict(answer, choice.score, choice.threshold)
        escalate = verdict.escalate and not _past(call.deadline)
        return Judged(verdict, escalate, small, whole, body, paid)

    async def answer(
        self, call: Call, choice: TierChoice, judged: Judged, opener: AttemptOpener
    ) -> Cascaded:
        """The kept small answer, or the large tier's (the held small one if it fails)."""
        small, body = judged.small, judged.body
        if not judged.escalate:
            assert small is not None  # a failed small tier always escalates
            return Cascaded(small, body, {"x-gateway-cascade": "kept", "x-gateway-tier": "small"})
        # Escalate: the small answer is dropped (kept aside only as a fallback). A held stream
        # is closed now; an answer read whole has freed its connection, and frees its replica's
        # load once it is not the fallback (else the replica counts it outstanding forever):
        # then it is ``lost``, its span ended at the verdict (``Attempt.set_aside``).
        if small is not None and not judged.whole:
            await small.discard()
        config, parsed = choice.config, call.parsed
        started = time.perf_counter()
        fallback = False
        try:
            large = await opener.open(call, call.rt.tier_targets(parsed.model, config.large))
        except GatewayError:
            fallback = bool(config.fallback_to_small and body)
            if not fallback:
                raise
        finally:  # the large tier answered, failed, or the client left meanwhile
            if small is not None and not fallback:
                small.set_aside(judged.judged_at)
        if fallback:
            assert small is not None  # a body was read from it
            headers = {
                "x-gateway-cascade": "escalated",
                "x-gateway-tier": "small",
                "x-gateway-tier-fallback": "small",
            }
            return Cascaded(small, body, headers, fallback=True)
        headers = {
            "x-gateway-cascade": "escalated",
            "x-gateway-tier": "large",
            "x-gateway-escalation-ms": f"{(time.perf_counter() - started) * 1000:.1f}",
        }
        return Cascaded(large, None, headers)


def _callers_limit(body: Mapping[str, Any], capped: bool) -> bool:
    """A "length" finish is the caller's doing: it set the output limit and the gateway did not
    lower it (``cap_output``). The large tier would stop there too."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return not capped and isinstance(limit, int) and not isinstance(limit, bool)


def _past(deadline: float | None) -> bool:
    """The caller's deadline is (all but) spent: within ``CLOCK_SLACK_S``, as a timer set for
    it may fire that much before ``perf_counter`` reaches it (uvloop)."""
    return deadline is not None and time.perf_counter() >= deadline - CLOCK_SLACK_S


def _non_streaming(parsed: ParsedRequest) -> ParsedRequest:
    body = {k: v for k, v in parsed.body.items() if k not in ("stream", "stream_options")}
    return replace(parsed, raw=json.dumps(body).encode(), body=body, stream=False)


async def _read_all(attempt: Attempt, deadline: float | None, max_bytes: int) -> tuple[bytes, Any]:
    """The small tier's whole answer (it was asked not to stream), and its JSON object.

    Whatever else comes is the small tier's failure (a ``GatewayError``: the cascade asks the
    large tier), counted against its replica when the replica is to blame (``read_whole``).
    """
    try:
        body = await read_whole(attempt, deadline, max_bytes)
    except GatewayError:
        attempt.finish(False)
        raise
    except BaseException:
        await attempt.discard()
        raise
    status = attempt.response.status
    data = _loads(body) if status == 200 else None
    if not isinstance(data, dict):
        why = f"the small tier answered {status}"
        if status == 200:
            why = "the small tier's answer is not a JSON object"
            attempt.fail("bad_answer", why)
        attempt.finish(False)
        raise UpstreamError(why, code="tier_failed")
    return body, data


def _failed(attempt: Attempt) -> None:
    """A read that failed: the connection is closed, the replica's load released."""
    attempt.response.close()
    attempt.finish(False)


def _loads(body: bytes) -> Any:
    try:
        return upstream_json.loads(body)
    except ValueError:
        return None


def _answer_of(data: dict[str, Any], endpoint: Endpoint) -> tuple[SmallAnswer, Usage | None]:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        return SmallAnswer("", finish_reason="error"), None
    if not isinstance(choice, dict):
        return SmallAnswer("", finish_reason="error"), None
    usage = Usage.read(data.get("usage"))
    finish = choice.get("finish_reason")
    return SmallAnswer(
        _text(choice, endpoint, "message"),
        _logprobs(choice),
        finish if isinstance(finish, str) else None,
        tool_calls=len(_tool_calls(choice, endpoint, "message")),
    ), usage


def _text(choice: dict[str, Any], endpoint: Endpoint, holder: str) -> str:
    """The text of a choice (chat: in its ``message`` or ``delta``); "" when it has none, or
    something else than a string there."""
    part = choice.get(holder) if endpoint is Endpoint.CHAT else choice
    text = (
        part.get("content" if endpoint is Endpoint.CHAT else "text")
        if isinstance(part, dict)
        else None
    )
    return text if isinstance(text, str) else ""


def _tool_calls(choice: dict[str, Any], endpoint: Endpoint, holder: str) -> list[Any]:
    """The tool calls of a chat choice (in its ``message`` or ``delta``), or a legacy
    ``function_call`` as one; [] for anything else."""
    part = choice.get(holder) if endpoint is Endpoint.CHAT else None
    if not isinstance(part, dict):
        return []
    calls = part.get("tool_calls")
    if isinstance(calls, list):
        return [c for c in calls if isinstance(c, dict)]
    return [part["function_call"]] if isinstance(part.get("function_call"), dict) else []


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        content = lp.get("content")
        if isinstance(content, list):  # chat
            return [
                float(t["logprob"])
                for t in content
                if isinstance(t, dict) and _number(t.get("logprob"))
            ]
        tokens = lp.get("token_logprobs")
        if isinstance(tokens, list):  # completions
            return [float(t) for t in tokens if _number(t)]
    return None


def _number(value: Any) -> bool:
    """A logprob ``float`` takes: a float, or an integer a double holds."""
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**53) <= value <= 2**53
    return isinstance(value, float)


async def _hold(attempt: Attempt, tokens: int, endpoint: Endpoint, call: Call) -> SmallAnswer:
    """Read the small stream until ``tokens`` chunks of content or tool calls, its end, or
    the deadline.

    The bytes read are kept in ``attempt.first`` for the relay to send first.
    """
    held = [attempt.first] if attempt.first else []
    framing = Framing()  # bounds what is held: an event that never ends fails the tier
    splitter = EventSplitter()
    pieces: list[str] = []
    calls: set[int] = set()  # the tool calls begun (their ``index``)
    chunks = 0  # chunks that carried text or a tool call's part
    finish = None
    done = ended = False

    def scan(events: Iterable[bytes]) -> None:
        nonlocal finish, done, chunks
        for event in events:
            for payload in payloads(event):
                if payload == DONE:
                    done = True
                    continue
                try:
                    choice = upstream_json.loads(payload)["choices"][0]
                except (ValueError, KeyError, IndexError, TypeError):
                    continue
                if not isinstance(choice, dict):
                    continue
                text = _text(choice, endpoint, "delta")
                if text:
                    pieces.append(text)
                deltas = _tool_calls(choice, endpoint, "delta")
                for delta in deltas:
                    index = delta.get("index", 0)
                    calls.add(index if isinstance(index, int) else 0)
                chunks += bool(text or deltas)
                reason = choice.get("finish_reason")
                finish = reason if isinstance(reason, str) and reason else finish

    remaining = None if call.deadline is None else call.deadline - time.perf_counter()
    window = asyncio.timeout(remaining)
    try:
        scan(splitter.feed(framing.feed(b"".join(held))))
        async with window:
            while not done and chunks < tokens:
                data = await attempt.response.content.readany()
                if not data:
                    ended = True
                    break
                if attempt.first_at is None:
                    attempt.first_at = time.perf_counter()
                held.append(data)
                scan(splitter.feed(framing.feed(data)))
    except TimeoutError as exc:
        if not window.expired():  # aiohttp's read timer: idle_s between reads (not the clocks:
            # uvloop may fire the deadline's timer a little before perf_counter reaches it)
            attempt.fail("idle_timeout", "the stream stopped coming (idle_s)")
            _failed(attempt)
            raise UpstreamTimeout("the small tier stopped sending", code="tier_failed") from exc
        # the deadline passed while holding: the small answer is kept, the relay ends it at once
    except aiohttp.ClientError as exc:  # a broken connection, or the stream's error event
        attempt.fail("answer_broken", "the connection broke during the stream")
        _failed(attempt)
        raise UpstreamError("the small tier's stream broke off", code="tier_failed") from exc
    except EventTooLong as exc:
        attempt.fail("bad_answer", "an SSE event that never ended")
        _failed(attempt)
        raise UpstreamError(f"the small tier's stream sent {exc}", code="tier_failed") from exc
    except BaseException:
        await attempt.discard()
        raise
    if ended and not done:  # no end of stream: cut short, or not a stream at all
        attempt.fail("answer_broken", "a stream that ended early")
        _failed(attempt)
        raise UpstreamError("the small tier's stream ended early", code="tier_failed")
    attempt.first = b"".join(held)
    return SmallAnswer("".join(pieces), None, finish, complete=done, tool_calls=len(calls))
