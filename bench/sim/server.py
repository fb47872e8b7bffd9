"""The HTTP face of one simulated replica: the subset of vLLM's OpenAI server a gateway uses.

Routes: POST /v1/chat/completions and /v1/completions (streaming as OpenAI SSE chunks ending
with ``data: [DONE]``, usage included), GET /v1/models, /health, /version, /metrics (vLLM's
metric names), POST /tokenize and /detokenize (vLLM's shapes) and /reset_prefix_cache.
Outputs always run to ``max_tokens`` (as with ``ignore_eos``); ``X-Vllm-Priority`` or
``priority`` order the queue when the profile's policy is "priority". A client that goes away
aborts its request, as in vLLM.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any

from aiohttp import web

from bench.sim.engine import RequestOutput, RequestRejected
from bench.sim.replica import SimReplica
from bench.sim.tokenizer import detokenize, render_chat, tokenize

replica_key = web.AppKey("replica", SimReplica)


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error(message: str, status: int, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


def _check_model(replica: SimReplica, body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is not None and model != replica.served_model_name:
        raise _BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
    return replica.served_model_name


def _max_tokens(replica: SimReplica, body: Mapping[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return replica.params.default_max_tokens
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _BadRequest("max_tokens must be a positive integer")
    return value


def _priority(request: web.Request, body: Mapping[str, Any]) -> int:
    raw = request.headers.get("X-Vllm-Priority", body.get("priority", 0))
    try:
        return int(raw)
    except (TypeError, ValueError) as exc:
        raise _BadRequest("priority must be an integer") from exc


def _prompt_ids(body: Mapping[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    raise _BadRequest("prompt must be a string, a list of token ids, or a list of one string")


def _chat_ids(body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _BadRequest("messages must be a list of objects")
    return tokenize(render_chat(messages, bool(body.get("add_generation_prompt", True))))


def _usage(last: RequestOutput | None, num_prompt: int) -> dict[str, Any]:
    completion = last.num_output_tokens if last else 0
    cached = last.num_cached_tokens if last else 0
    return {
        "prompt_tokens": num_prompt,
        "total_tokens": num_prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    replica = request.app[replica_key]
    body = await _json_body(request)
    model = _check_model(replica, body)
    ids = _chat_ids(body) if chat else _prompt_ids(body)
    max_tokens = _max_tokens(replica, body)
    if body.get("n", 1) != 1:
        raise _BadRequest("only n=1 is simulated")
    try:
        stream = replica.submit(ids, max_tokens, priority=_priority(request, body))
    except RequestRejected as exc:
        raise _BadRequest(str(exc)) from exc
    prefix = "chatcmpl" if chat else "cmpl"
    meta = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    if body.get("stream"):
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return await _stream(request, stream, meta, chat, len(ids), include_usage)
    last: RequestOutput | None = None
    texts: list[str] = []
    async for out in stream:
        texts.append(detokenize(out.new_token_ids))
        last = out
    text = "".join(texts)
    finish = last.finish_reason if last else "length"
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    choice["stop_reason"] = None
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    obj = "chat.completion" if chat else "text_completion"
    return web.json_response(
        {**meta, "object": obj, "choices": [choice], "usage": _usage(last, len(ids))},
        dumps=_dumps,
    )


async def _stream(
    request: web.Request,
    stream: AsyncIterable[RequestOutput],
    meta: dict[str, Any],
    chat: bool,
    num_prompt: int,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {_dumps({**meta, 'object': obj, 'choices': choices, **extra})}\n\n".encode()

    if chat:
        first = {"role": "assistant", "content": ""}
        await resp.write(
            chunk([{"index": 0, "delta": first, "logprobs": None, "finish_reason": None}])
        )
    last: RequestOutput | None = None
    async for out in stream:
        text = detokenize(out.new_token_ids)
        piece: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        if chat:
            piece["delta"] = {"content": text}
        else:
            piece["text"] = text
        if out.finished:
            piece["stop_reason"] = None
        await resp.write(chunk([piece]))
        last = out
    if include_usage:
        await resp.write(chunk([], usage=_usage(last, num_prompt)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def models(request: web.Request) -> web.Response:
    replica = request.app[replica_key]
    name = replica.served_model_name
    card = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": name,
        "parent": None,
        "max_model_len": replica.params.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "0.32.0+sim"})


async def metrics(request: web.Request) -> web.Response:
    replica = request.app[replica_key]
    text = replica.engine.prometheus_text(replica.served_model_name)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def tokenize_route(request: web.Request) -> web.Response:
    replica = request.app[replica_key]
    body = await _json_body(request)
    _check_model(replica, body)
    ids = _chat_ids(body) if "messages" in body else _prompt_ids(body)
    return web.json_response(
        {"count": len(ids), "max_model_len": replica.params.max_model_len, "tokens": ids}
    )


async def detokenize_route(request: web.Request) -> web.Response:
    body = await _json_body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise _BadRequest("tokens must be a list of token ids")
    return web.json_response({"prompt": detokenize(tokens)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[replica_key].engine.reset_prefix_cache()
    return web.Response(status=200 if ok else 409)


Handler = Callable[[web.Request], Any]


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
    except _BadRequest as exc:
        return _error(str(exc), exc.status, exc.kind)
    return response


def create_replica_app(replica: SimReplica) -> web.Application:
    """An aiohttp app serving ``replica``; starting the app starts the replica's engine loop."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024**2)
    app[replica_key] = replica

    async def replica_ctx(app: web.Application) -> AsyncIterator[None]:
        await replica.start()
        yield
        await replica.stop()

    app.cleanup_ctx.append(replica_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app
