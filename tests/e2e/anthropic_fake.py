"""A deterministic fake of Anthropic's Messages API that checks what the gateway sends it.

Every request is validated the way the real API would refuse it (the key and version headers, a
``max_tokens``, roles that alternate and start with the user, ``system`` only at the top level,
``tool_result`` blocks that answer the ``tool_use`` blocks of the turn before, known fields
only); a request that breaks a rule is answered 400 ``invalid_request_error`` and recorded in
``problems``, so a test fails loudly. Answers, streamed or not, come in Anthropic's format; a
script of per-request actions (``"tool_use"``, ``"tool_use_no_input"``, ``"status:529"``,
``"midstream_error"``, ``"error_first"``, ``"html_200"``, ``"ignore_stream"``...) picks the
unusual ones. A ``tool_choice`` naming a tool is answered with a call of that tool whose
``input`` follows its ``input_schema`` (what structured output through a forced tool needs);
``thinking`` adds a signed thinking block before the answer (and is refused, as the real API
refuses it, with a forced tool choice, a temperature, a budget under 1,024 or not under
``max_tokens``, or a request continuing a tool loop whose first assistant turn does not start
with its thinking block); a thinking block sent back must carry the signature the fake gave it. ``POST /v1/messages/count_tokens`` counts words (3 per message more).
Streamed events are written in two pieces cut inside the event, so the gateway meets events
that straddle reads. ``usage`` is the answer's counts (``OMIT``: none), which ``message_start``
(with ``output_tokens: 1``, as the real API) and ``message_delta`` (the output) report unless
``stream_usage`` names theirs; ``delta_pause_ms`` holds ``message_delta`` back (a client may
leave meanwhile).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bench.fake_upstream import site_port

API_KEY = "sk-ant-test-key"
USAGE = {"input_tokens": 11, "output_tokens": 7, "cache_read_input_tokens": 2}
OMIT: Any = object()  # a usage left out of an answer or an event
_TOP_LEVEL = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "stream",
    "thinking",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeAnthropic:
    reply: str = "Hello from the fake Claude."
    pieces: int = 4  # text deltas a streamed reply is cut into
    event_interval_ms: float = 0  # a pause before each streamed event (a model's decode speed)
    usage: Any = field(default_factory=lambda: dict(USAGE))  # the answer's counts (module doc)
    stream_usage: dict[str, Any] = field(default_factory=dict)  # an event type's own usage
    delta_pause_ms: float = 0  # a pause before message_delta
    script: deque[str] = field(default_factory=deque)
    requests: list[Seen] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    signed: dict[str, str] = field(default_factory=dict)  # signature -> the thinking it signs

    def queue(self, *actions: str) -> None:
        self.script.extend(actions)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        return app

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(Seen(dict(request.headers), body))
        if request.headers.get("x-api-key") != API_KEY:
            return _error(401, "invalid x-api-key")
        try:
            problem = _check_headers(request) or _check_messages(body.get("messages"))
            if problem is None:
                words = 0
                for message in body["messages"]:
                    content = message["content"]
                    texts = (
                        [content]
                        if isinstance(content, str)
                        else [b.get("text", "") for b in content]
                    )
                    words += 3 + sum(len(t.split()) for t in texts)
                return web.json_response({"input_tokens": words})
        except _UNREADABLE as exc:
            problem = f"malformed request body ({type(exc).__name__})"
        return self._problem(problem)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self._problem("body is not JSON")
        self.requests.append(Seen(dict(request.headers), body))
        if request.headers.get("x-api-key") != API_KEY:
            return _error(401, "invalid x-api-key")
        try:
            problem = _check_headers(request) or _check_body(body) or self._check_signatures(body)
        except _UNREADABLE as exc:  # as the real API: a 400
            problem = f"malformed request body ({type(exc).__name__})"
        if problem is not None:
            return self._problem(problem)
        action = self.script.popleft() if self.script else "ok"
        if action.startswith("status:"):
            status = int(action.split(":")[1])
            return _error(status, f"fake {status}")
        if action == "html_200":  # a proxy's page in the way
            return web.Response(
                text="<html>upstream connect error</html>", content_type="text/html"
            )
        message = self._answer(body, action)
        if body.get("stream") and action != "ignore_stream":
            return await self._stream(request, message, action)
        return web.json_response(message)

    def _check_signatures(self, body: dict[str, Any]) -> str | None:
        """A thinking block sent back must be one this API signed, unchanged."""
        for i, message in enumerate(body["messages"]):
            content = message["content"]
            for block in content if isinstance(content, list) else ():
                if block.get("type") != "thinking":
                    continue
                if self.signed.get(block.get("signature")) != block.get("thinking"):
                    return f"messages.{i}: Invalid `signature` in `thinking` block"
        return None

    def _problem(self, problem: str) -> web.Response:
        self.problems.append(problem)
        return _error(400, problem)

    def _answer(self, body: dict[str, Any], action: str) -> dict[str, Any]:
        content: list[dict[str, Any]]
        stop = "end_turn"
        results = _tool_results(body["messages"][-1])
        forced = body.get("tool_choice") or {}
        if forced.get("type") == "tool":
            tool = next(t for t in body["tools"] if t["name"] == forced["name"])
            content = [
                {
                    "type": "tool_use",
                    "id": "toolu_forced",
                    "name": tool["name"],
                    "input": _instance(tool["input_schema"]),
                }
            ]
            stop = "tool_use"
        elif action in ("tool_use", "tool_use_no_input") and body.get("tools"):
            given = {"city": "Paris", "unit": "celsius"} if action == "tool_use" else {}
            content = [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": body["tools"][0]["name"],
                    "input": given,
                },
            ]
            stop = "tool_use"
        elif results:
            content = [{"type": "text", "text": "The tool said: " + "; ".join(results)}]
        else:
            content = [{"type": "text", "text": self.reply}]
        if action == "max_tokens":
            stop = "max_tokens"
        if (body.get("thinking") or {}).get("type") == "enabled":
            signature = f"sig-fake-{len(self.requests)}"
            self.signed[signature] = "Let me think."
            thought = {"type": "thinking", "thinking": "Let me think.", "signature": signature}
            content = [thought, *content]
        message = {
            "id": f"msg_fake{len(self.requests):03d}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
        }
        return _with_usage(message, self.usage)

    async def _stream(
        self, request: web.Request, message: dict[str, Any], action: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        counts = message.get("usage", OMIT)
        told = isinstance(counts, dict)
        start = {k: v for k, v in message.items() if k != "usage"}
        start.update(content=[], stop_reason=None)
        start_counts = {**counts, "output_tokens": 1} if told else counts
        _with_usage(start, self.stream_usage.get("message_start", start_counts))
        events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
        for index, block in enumerate(message["content"]):
            events.extend(_block_events(index, block, self.pieces))
            if index == 0:
                events.append({"type": "ping"})
        overloaded = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"},
        }
        if action == "midstream_error":
            events = [*events[:4], overloaded]
        elif action == "error_first":  # as Anthropic under load: a 200, then the error
            events = [{"type": "ping"}, overloaded]
        else:
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            }
            delta_counts = {"output_tokens": counts.get("output_tokens")} if told else counts
            events.append(_with_usage(delta, self.stream_usage.get("message_delta", delta_counts)))
            events.append({"type": "message_stop"})
        for event in events:
            if self.event_interval_ms:
                await asyncio.sleep(self.event_interval_ms / 1000)
            if self.delta_pause_ms and event["type"] == "message_delta":
                await asyncio.sleep(self.delta_pause_ms / 1000)
            data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            cut = len(data) // 3
            await resp.write(data[:cut])
            await asyncio.sleep(0)
            await resp.write(data[cut:])
        await resp.write_eof()
        return resp


def _with_usage(holder: dict[str, Any], usage: Any) -> dict[str, Any]:
    if usage is not OMIT:
        holder["usage"] = usage
    return holder


def _instance(schema: dict[str, Any]) -> Any:
    """A value that follows ``schema`` (objects with every property, the first enum value)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: _instance(v) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [_instance(schema.get("items") or {"type": "string"})]
    return {"integer": 1, "number": 1.5, "boolean": True, "null": None}.get(str(kind), "text")


def _block_events(index: int, block: dict[str, Any], pieces: int) -> list[dict[str, Any]]:
    if block["type"] == "thinking":
        return [
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "thinking_delta", "thinking": block["thinking"]},
            },
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "signature_delta", "signature": block["signature"]},
            },
            {"type": "content_block_stop", "index": index},
        ]
    if block["type"] == "text":
        text = block["text"]
        step = max(1, -(-len(text) // pieces))
        deltas = [
            {"type": "text_delta", "text": text[i : i + step]} for i in range(0, len(text), step)
        ]
        opening: dict[str, Any] = {"type": "text", "text": ""}
    else:
        args = json.dumps(block["input"]) if block["input"] else ""  # no input: one empty delta
        half = len(args) // 2
        deltas = [
            {"type": "input_json_delta", "partial_json": ""},
            *(
                {"type": "input_json_delta", "partial_json": part}
                for part in (args[:half], args[half:])
                if part
            ),
        ]
        opening = {**block, "input": {}}
    return [
        {"type": "content_block_start", "index": index, "content_block": opening},
        *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": index},
    ]


# What checking a body of the wrong shape raises here: the real API answers those with a 400.
_UNREADABLE = (TypeError, AttributeError, KeyError, IndexError)


def _tool_results(message: dict[str, Any]) -> list[str]:
    if not isinstance(message.get("content"), list):
        return []
    out = []
    for block in message["content"]:
        if block.get("type") == "tool_result":
            content = block.get("content", [])
            if isinstance(content, str):  # the API takes a string as well as text blocks
                out.append(content)
                continue
            texts = [c["text"] for c in content if c.get("type") == "text"]
            out.append("".join(texts))
    return out


def _error(status: int, message: str) -> web.Response:
    kind = _ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.json_response(body, status=status, headers={"request-id": "req_fake"})


def _check_headers(request: web.Request) -> str | None:
    if request.headers.get("anthropic-version") != "2023-06-01":
        return "anthropic-version header is missing or wrong"
    if "Authorization" in request.headers:
        return "a bearer token was sent to Anthropic"
    if not request.headers.get("Content-Type", "").startswith("application/json"):
        return "content-type is not JSON"
    return None


def _check_body(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "body is not an object"
    unknown = set(body) - _TOP_LEVEL
    if unknown:
        return f"unknown fields: {sorted(unknown)}"
    if not isinstance(body.get("model"), str):
        return "model: required"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens: required"
    system = body.get("system")
    if system is not None and not (
        isinstance(system, str)
        or (
            isinstance(system, list)
            and all(
                isinstance(b, dict) and b.get("type") == "text" and b.get("text") for b in system
            )
        )
    ):
        return "system: a string or text blocks"
    temperature = body.get("temperature")
    if temperature is not None and not 0 <= temperature <= 1:
        return "temperature: 0 to 1"
    for tool in body.get("tools", []):
        if set(tool) - {"name", "description", "input_schema"} or "input_schema" not in tool:
            return f"tools: bad tool {tool}"
    forced = body.get("tool_choice") or {}
    if forced.get("type") == "tool" and forced.get("name") not in {
        t["name"] for t in body.get("tools", [])
    }:
        return "tool_choice: names no tool"
    problem = _check_thinking(body) or _check_messages(body.get("messages"))
    if problem is None and (body.get("thinking") or {}).get("type") == "enabled":
        problem = _check_thinking_turn(body["messages"])
    return problem


def _check_thinking(body: dict[str, Any]) -> str | None:
    thinking = body.get("thinking")
    if thinking is None or thinking.get("type") == "disabled":
        return None
    budget = thinking.get("budget_tokens")
    if thinking.get("type") != "enabled" or not isinstance(budget, int):
        return "thinking: type enabled with budget_tokens"
    if budget < 1024 or budget >= body["max_tokens"]:
        return "thinking.budget_tokens: at least 1024 and less than max_tokens"
    if (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
        return "thinking may not be enabled when tool_choice forces tool use"
    if body.get("temperature") is not None:
        return "temperature may only be set when thinking is disabled"
    return None


def _check_thinking_turn(messages: list[dict[str, Any]]) -> str | None:
    """Anthropic's rule for thinking with tools: a request that continues a tool loop (its last
    user turn holds tool results) must send back the thinking block the loop's first assistant
    turn (the first after the user's own last turn) began with."""

    def blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
        content = message["content"]
        return [{"type": "text", "text": content}] if isinstance(content, str) else content

    def has_results(message: dict[str, Any]) -> bool:
        return any(b.get("type") == "tool_result" for b in blocks(message))

    if messages[-1]["role"] != "user" or not has_results(messages[-1]):
        return None
    first = None
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not has_results(messages[i]):
            break
        if messages[i]["role"] == "assistant":
            first = i
    found = None if first is None else blocks(messages[first])[0].get("type")
    if found is None or found in ("thinking", "redacted_thinking"):
        return None
    return (
        f"messages.{first}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        f"`{found}`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks)."
    )


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty array"
    previous_tool_uses: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: user or assistant, not {role!r}"
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            return f"messages.{i}: roles must alternate, starting with user"
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not blocks:
            return f"messages.{i}.content: non-empty"
        tool_uses: set[str] = set()
        answered: set[str] = set()
        for j, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text" and not block.get("text"):
                return f"messages.{i}: text content blocks must be non-empty"
            if kind == "tool_use":
                if role != "assistant" or not isinstance(block.get("input"), dict):
                    return f"messages.{i}: a tool_use block belongs to the assistant"
                tool_uses.add(block["id"])
            elif kind == "tool_result":
                if role != "user" or block.get("tool_use_id") not in previous_tool_uses:
                    return f"messages.{i}: tool_result without a matching tool_use"
                if j != len(answered):
                    return f"messages.{i}: tool_result blocks must come first"
                answered.add(block["tool_use_id"])
            elif kind == "image":
                if block.get("source", {}).get("type") not in ("base64", "url"):
                    return f"messages.{i}: bad image source"
            elif kind == "document":
                source = block.get("source", {})
                if (source.get("type"), source.get("media_type")) != ("base64", "application/pdf"):
                    return f"messages.{i}: a document here must be a base64 PDF"
            elif kind in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    return f"messages.{i}: thinking blocks belong to the assistant"
            elif kind != "text":
                return f"messages.{i}: unknown block type {kind!r}"
        if previous_tool_uses and answered != previous_tool_uses:
            return f"messages.{i}: every tool_use needs its tool_result in the next turn"
        previous_tool_uses = tool_uses
    return None


async def start_fake_anthropic(fake: FakeAnthropic) -> tuple[web.AppRunner, str]:
    """Start ``fake`` on loopback; returns the runner and its base URL (ending in /v1)."""
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site_port(site)}/v1"
