"""A deterministic OpenAI-compatible upstream for fault, timing and overhead tests.

Behaviour is fixed by its settings (latency before the response, number of stream chunks and
the gap between them) and by a script of per-request actions that a test queues up
(``"ok"``, ``"status:503"``, ``"drop"``, ``"hang"``, ``"midstream_drop"``, ``"hold_end:0.2"``:
a stream's ``data: [DONE]`` sent, its end held back 0.2 s; ``"tool_call"``: a call of the
request's first tool; ``"html"``: a 200 error page; ``"truncated"``: a JSON answer cut short;
``"stall_body"``: a JSON answer's headers and first bytes, then nothing more; ``"ttft:2"``: a
stream's head at once, its first chunk 2 s later, as vLLM sends them;
``"big:N"``: an answer padded by N bytes; ``"reply:TEXT"``: a whole answer saying TEXT;
``"past_context"``: vLLM's 400 for a ``max_tokens`` past the model's context;
``"ratelimit:0.5"``: a 429 as OpenAI sends it, asking
to retry in 0.5 s...). With ``gzip`` every answer is compressed whatever the client accepts, as
CDNs do. Nothing is random. Like vLLM it also serves ``POST /tokenize`` and ``POST
/v1/responses`` (``bench.fake_responses``). Usage is reported as ``prompt_tokens`` /
``completion_tokens`` (``cached_tokens`` of the prompt in ``prompt_tokens_details``; none with
``report_usage: False``; without the counts named in ``usage_without``); ``headers`` go on
every answer (e.g. ``x-ratelimit-*``). The ``tool_calls`` it adds can take the shapes other servers send (``tool_call_style``).
Run standalone: ``python -m bench.fake_upstream --port 9000 --latency-ms 1 --chunks 64``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# vLLM answers with its own request id; a gateway must not pass it on as the caller's.
UPSTREAM_ID = {"X-Request-Id": "fake-upstream-request-id"}


@dataclass
class FakeSettings:
    models: tuple[str, ...] = ("fake-model",)
    latency_ms: float = 0.0  # before the response headers (non-stream) or first chunk
    chunks: int = 4  # streamed content chunks
    chunk_interval_ms: float = 0.0
    reply: str = "hello from the fake upstream"
    gzip: bool = False  # compress every answer, whatever the client accepts (as CDNs do)
    prompt_tokens: int = 5
    completion_tokens: int = 6  # non-streamed answers (a stream reports its chunk count)
    report_usage: bool = True  # False: an upstream that reports no usage at all
    usage_without: tuple[str, ...] = ()  # counts left out of the usage (an incomplete one)
    headers: dict[str, str] = field(default_factory=dict)  # sent with every answer
    tool_calls: int = 0  # chat answers also call this many tools (finish_reason tool_calls)
    # How those calls are sent: "openai"; "object" (arguments as a JSON object, as HF TGI
    # does); streamed, "no_index" (whole calls in one chunk without index, as Gemini's OpenAI
    # endpoint does) or "interleaved" (each call's arguments in two fragments, the calls'
    # fragments taking turns)
    tool_call_style: str = "openai"
    cached_tokens: int = 0  # reported as prompt_tokens_details.cached_tokens when > 0
    reasoning: str = ""  # returned as reasoning_content (streamed first) when set
    finish_reason: str = "stop"  # of answers without tool calls ("length": one cut short)
    # vLLM's: the stop string that ended the answer, on its choice (a stream: on every chunk,
    # null until the last); None: not sent, as OpenAI's API
    stop_reason: str | None = None


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeUpstream:
    settings: FakeSettings = field(default_factory=FakeSettings)
    healthy: bool = True
    script: deque[str] = field(default_factory=deque)
    requests: list[RecordedRequest] = field(default_factory=list)
    active: int = 0
    peak_active: int = 0  # the most requests it served at once
    disconnected: int = 0  # requests whose client went away before the response finished
    completed: int = 0
    record: bool = True

    def queue(self, *actions: str) -> None:
        self.script.extend(actions)

    def record_request(self, request: web.Request, body: dict[str, Any]) -> None:
        if self.record:
            self.requests.append(RecordedRequest(request.path, dict(request.headers), body))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=128 * 1024 * 1024)  # vLLM takes large bodies
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/embeddings", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        from bench.fake_responses import add_routes

        add_routes(app, self)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.settings.models]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            f'vllm:num_requests_running{{model_name="{self.settings.models[0]}"}} {self.active}\n'
            f'vllm:num_requests_waiting{{model_name="{self.settings.models[0]}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.settings.models[0]}"}} 0.0\n'
        )
        return web.Response(text=text)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        self.record_request(request, body)
        action = self.script.popleft() if self.script else "ok"
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            return await self._act(request, body, action)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected += 1
            raise
        finally:
            self.active -= 1

    async def _act(
        self, request: web.Request, body: dict[str, Any], action: str
    ) -> web.StreamResponse:
        if action.startswith("status:"):
            status = int(action.split(":", 1)[1])
            err = {"error": {"message": f"fake {status}", "type": "fake_error", "code": status}}
            return web.json_response(err, status=status)
        if action.startswith("ratelimit:"):
            wait_s = float(action.split(":", 1)[1])
            err = {"error": {"message": "Rate limit reached", "type": "requests",
                             "code": "rate_limit_exceeded"}}  # fmt: skip
            headers = {
                "retry-after-ms": str(int(wait_s * 1000)),
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": f"{wait_s}s",
            }
            return web.json_response(err, status=429, headers=headers)
        if action == "past_context":  # vLLM's refusal of an output limit past the context
            return web.json_response(_past_context(body), status=400)
        if action == "drop":
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("fake drop")
        if action == "hang":
            await asyncio.sleep(3600)
        if action == "html":  # a proxy's error page, with a 200
            return web.Response(
                text="<html><body>Bad gateway</body></html>", content_type="text/html"
            )
        if action == "truncated":  # a JSON answer cut short, then the connection closes
            return await self._truncated(request)
        if action == "stall_body":  # a JSON answer begun, never finished
            return await self._stalled(request)
        if action.startswith("big:"):  # a valid answer of about N bytes
            size = int(action.split(":", 1)[1])
            answer = self._full(body, request.path.endswith("/chat/completions"))
            answer["padding"] = "x" * size
            return web.json_response(answer, headers=UPSTREAM_ID)
        if action.startswith("sleep:"):
            await asyncio.sleep(float(action.split(":", 1)[1]))
        if self.settings.latency_ms:
            await asyncio.sleep(self.settings.latency_ms / 1000)
        if request.path.endswith("/embeddings"):
            self.completed += 1
            return web.json_response(self._embeddings(body), headers=self.settings.headers)
        chat = request.path.endswith("/chat/completions")
        if body.get("stream"):
            hold_end = float(action.split(":", 1)[1]) if action.startswith("hold_end:") else 0.0
            return await self._stream(
                request,
                body,
                chat,
                midstream_drop=action == "midstream_drop",
                hold_end=hold_end,
                tool_call=action == "tool_call",
                ttft=float(action.split(":", 1)[1]) if action.startswith("ttft:") else 0.0,
            )
        self.completed += 1
        resp = web.json_response(
            self._full(body, chat, action), headers={**UPSTREAM_ID, **self.settings.headers}
        )
        if self.settings.gzip:
            resp.enable_compression(web.ContentCoding.gzip)
        return resp

    async def _truncated(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 400
        await resp.prepare(request)
        await resp.write(b'{"id": "fake-1", "object": "chat.completion", "choices": [')
        assert request.transport is not None
        request.transport.close()
        raise ConnectionResetError("fake truncated answer")

    async def _stalled(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"id": "fake-1", "object": "chat.completion", "choices": [')
        await asyncio.sleep(3600)
        return resp

    def _embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        """One 3-dimensional vector per input: (its length, its index, 0.5)."""
        raw = body.get("input")
        inputs: list[Any] = [raw] if isinstance(raw, str) or not isinstance(raw, list) else raw
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one array of token ids
        data = []
        for i, item in enumerate(inputs):
            vector = [float(len(item) if isinstance(item, str | list) else 0), float(i), 0.5]
            value: list[float] | str = vector
            if body.get("encoding_format") == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(item) for item in inputs if isinstance(item, str | list))
        return {
            "object": "list",
            "model": body.get("model", self.settings.models[0]),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def usage(self, prompt: int, completion: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.settings.cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": self.settings.cached_tokens}
        for count in self.settings.usage_without:
            del out[count]
        return out

    def _full(self, body: dict[str, Any], chat: bool, action: str = "ok") -> dict[str, Any]:
        n = int(body.get("n") or 1)
        text = action.removeprefix("reply:") if action.startswith("reply:") else self.settings.reply
        choices: list[dict[str, Any]] = []
        for i in range(n):
            if chat:
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                finish = self.settings.finish_reason
                if self.settings.tool_calls:
                    style = self.settings.tool_call_style
                    msg["tool_calls"] = [
                        _tool_call(j, style) for j in range(self.settings.tool_calls)
                    ]
                    finish = "tool_calls"
                if self.settings.reasoning:
                    msg["reasoning_content"] = self.settings.reasoning
                call = _first_tool_call(body) if action == "tool_call" else None
                if call is not None:
                    msg["content"], msg["tool_calls"], finish = None, [call], "tool_calls"
                choices.append(
                    {"index": i, "message": msg, "finish_reason": finish, "logprobs": None}
                    | self._stop_reason(finish)
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "finish_reason": self.settings.finish_reason,
                        "logprobs": None,
                    }
                    | self._stop_reason(self.settings.finish_reason)
                )
        return {
            "id": "fake-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", self.settings.models[0]),
            "choices": choices,
            **(
                {"usage": self.usage(self.settings.prompt_tokens, self.settings.completion_tokens)}
                if self.settings.report_usage
                else {}
            ),
        }

    def _stop_reason(self, finish: str | None) -> dict[str, Any]:
        if self.settings.stop_reason is None:
            return {}
        return {"stop_reason": self.settings.stop_reason if finish == "stop" else None}

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        midstream_drop: bool,
        hold_end: float = 0.0,
        tool_call: bool = False,
        ttft: float = 0.0,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={**UPSTREAM_ID, **self.settings.headers, "Content-Type": "text/event-stream"}
        )
        if self.settings.gzip:
            resp.enable_compression(web.ContentCoding.gzip)
        await resp.prepare(request)
        if ttft:  # the head went out; the first token takes this long
            await asyncio.sleep(ttft)
        model = body.get("model", self.settings.models[0])
        kind = "chat.completion.chunk" if chat else "text_completion"
        gap = self.settings.chunk_interval_ms / 1000
        head = {"id": "fake-1", "object": kind, "created": 0, "model": model}
        if chat and self.settings.reasoning:
            thought = {"role": "assistant", "reasoning_content": self.settings.reasoning}
            await resp.write(
                _sse({**head, "choices": [{"index": 0, "delta": thought, "finish_reason": None}]})
            )
        call = _first_tool_call(body) if chat and tool_call else None
        if call is not None:
            for piece in _tool_call_deltas(call):
                await resp.write(_sse({**head, "choices": [piece]}))
        for i in range(self.settings.chunks if call is None else 0):
            if i and gap:
                await asyncio.sleep(gap)
            if chat:
                delta: dict[str, Any] = {"content": f"tok{i} "}
                if i == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
            else:
                choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None}
            after: list[list[dict[str, Any]]] = []  # tool calls in chunks of their own
            if i == self.settings.chunks - 1:
                choice["finish_reason"] = self.settings.finish_reason
                if chat and self.settings.tool_calls:
                    calls, *after = _streamed_tool_calls(
                        self.settings.tool_calls, self.settings.tool_call_style
                    )
                    if calls:
                        choice["delta"]["tool_calls"] = calls
                    choice["finish_reason"] = None if after else "tool_calls"
            choice.update(self._stop_reason(choice["finish_reason"]))
            chunk = {
                "id": "fake-1",
                "object": kind,
                "created": 0,
                "model": model,
                "choices": [choice],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            for calls in after:
                piece = {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}
                await resp.write(_sse({**head, "choices": [piece]}))
            if after:
                finish = {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
                await resp.write(_sse({**head, "choices": [finish]}))
            if midstream_drop and i == 1:
                assert request.transport is not None
                request.transport.close()
                raise ConnectionResetError("fake midstream drop")
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") and self.settings.report_usage:
            usage = self.usage(self.settings.prompt_tokens, self.settings.chunks)
            chunk = {
                "id": "fake-1",
                "object": kind,
                "created": 0,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        if hold_end:  # the answer is complete; the body's end (chunked terminator) comes later
            await asyncio.sleep(hold_end)
        await resp.write_eof()
        self.completed += 1
        return resp


def _past_context(body: dict[str, Any]) -> dict[str, Any]:
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    message = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
        f"context length is 4096 tokens and your request has 9 input tokens ({asked} > 4096 - "
        f"9). (parameter=max_tokens, value={asked})"
    )
    return {"error": {"message": message, "type": "BadRequestError", "param": "max_tokens",
                      "code": 400}}  # fmt: skip


def _tool_call(j: int, style: str = "openai") -> dict[str, Any]:
    arguments: Any = {"city": f"city-{j}"}
    if style != "object":
        arguments = json.dumps(arguments)
    return {
        "id": f"call-{j}",
        "type": "function",
        "function": {"name": f"tool_{j}", "arguments": arguments},
    }


def _streamed_tool_calls(n: int, style: str) -> list[list[dict[str, Any]]]:
    """The ``tool_calls`` of ``n`` streamed calls: first those of the last content chunk, then
    those of each chunk that follows it (``FakeSettings.tool_call_style``)."""
    calls = [{"index": j, **_tool_call(j, style)} for j in range(n)]
    if style == "no_index":
        return [[], [{k: v for k, v in call.items() if k != "index"} for call in calls]]
    if style != "interleaved":
        return [calls]
    heads, tails = [], []
    for call in calls:
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        heads.append([{**call, "function": {**call["function"], "arguments": arguments[:half]}}])
        tails.append([{"index": call["index"], "function": {"arguments": arguments[half:]}}])
    return [[], *heads, *tails]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _first_tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """A call of the request's first function tool (``{"city": "Paris"}``), or None."""
    tools = body.get("tools") or []
    if not tools or not isinstance(tools[0], dict):
        return None
    name = (tools[0].get("function") or {}).get("name", "")
    arguments = json.dumps({"city": "Paris"})
    return {
        "id": "call_fake1",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _tool_call_deltas(call: dict[str, Any]) -> list[dict[str, Any]]:
    """The call as a stream sends it: id and name first, then the arguments in two pieces."""
    args = call["function"]["arguments"]
    half = len(args) // 2
    first = {**call, "index": 0, "function": {"name": call["function"]["name"], "arguments": ""}}
    pieces: list[dict[str, Any]] = [{"role": "assistant", "tool_calls": [first]}]
    for part in (args[:half], args[half:]):
        pieces.append({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
    out: list[dict[str, Any]] = [{"index": 0, "delta": d, "finish_reason": None} for d in pieces]
    out.append({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    return out


def site_port(site: web.TCPSite) -> int:
    """The port a started site is bound to (useful with port 0)."""
    server = site._server
    sockets = getattr(server, "sockets", None)
    if not sockets:
        raise RuntimeError("the site is not started")
    port: int = sockets[0].getsockname()[1]
    return port


async def start_fake(
    fake: FakeUpstream, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start ``fake`` on loopback; returns the runner and its base URL (ending in /v1)."""
    runner = web.AppRunner(fake.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = site_port(site)
    return runner, f"http://{host}:{bound_port}/v1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-interval-ms", type=float, default=0.0)
    p.add_argument("--model", action="append", default=None)
    args = p.parse_args()
    settings = FakeSettings(
        models=tuple(args.model or ["fake-model"]),
        latency_ms=args.latency_ms,
        chunks=args.chunks,
        chunk_interval_ms=args.chunk_interval_ms,
    )
    fake = FakeUpstream(settings=settings, record=False)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass
    web.run_app(
        fake.app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
