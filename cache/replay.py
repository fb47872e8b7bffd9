"""Serve a cached answer: as one JSON response or as SSE chunks, like a fresh one.

A cached response is the upstream's JSON (``chat.completion`` or ``text_completion``). Replay
gives it a new id and timestamp and usage of zero work (nothing was generated for this
request); the streamed form has a role chunk, one content chunk per choice, a finish chunk,
the usage chunk when ``stream_options.include_usage`` asked for it, and ``data: [DONE]``.

``assemble_stream`` does the reverse for cache fills of streamed requests: it rebuilds the
complete response from the relayed chunks, or returns None when the stream did not finish.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from cache.semantic import CacheHit

ZERO_USAGE: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
_FINISHED = frozenset({"stop", "length", "tool_calls", "function_call"})


def cache_headers(hit: CacheHit | None) -> dict[str, str]:
    if hit is None:
        return {"x-gateway-cache": "miss"}
    headers: dict[str, str] = {"x-gateway-cache": hit.kind}
    if hit.similarity is not None:
        headers["x-gateway-cache-similarity"] = f"{hit.similarity:.4f}"
    return headers


def _fresh(stored: bytes | Mapping[str, Any], model: str | None) -> dict[str, Any]:
    data = json.loads(stored) if isinstance(stored, bytes | bytearray) else dict(stored)
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise ValueError("a cached response must be an object with 'choices'")
    prefix = "chatcmpl" if data.get("object") == "chat.completion" else "cmpl"
    data["id"] = f"{prefix}-cache-{uuid.uuid4().hex[:24]}"
    data["created"] = int(time.time())
    if model is not None:
        data["model"] = model
    data["usage"] = dict(ZERO_USAGE)
    return data


def replay_json(stored: bytes | Mapping[str, Any], *, model: str | None = None) -> bytes:
    return json.dumps(_fresh(stored, model), separators=(",", ":")).encode()


def _sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def replay_sse(
    stored: bytes | Mapping[str, Any], *, model: str | None = None, include_usage: bool = False
) -> list[bytes]:
    data = _fresh(stored, model)
    base: dict[str, Any] = {k: data[k] for k in ("id", "created", "model") if k in data}
    chat = data.get("object") == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    chunks: list[bytes] = []
    for choice in data["choices"]:
        index = choice.get("index", 0)
        if chat:
            message = choice.get("message") or {}
            delta: dict[str, Any] = {"role": message.get("role", "assistant"), "content": ""}
            chunks.append(_chunk(base, obj, index, {"delta": delta}, include_usage))
            body: dict[str, Any] = {}
            if message.get("content"):
                body["content"] = message["content"]
            if message.get("tool_calls"):
                body["tool_calls"] = [
                    {**call, "index": i} for i, call in enumerate(message["tool_calls"])
                ]
            if message.get("refusal"):
                body["refusal"] = message["refusal"]
            if body:
                chunks.append(_chunk(base, obj, index, {"delta": body}, include_usage))
            finish = {"delta": {}, "finish_reason": choice.get("finish_reason", "stop")}
            chunks.append(_chunk(base, obj, index, finish, include_usage))
        else:
            text = {"text": choice.get("text", ""), "finish_reason": None}
            chunks.append(_chunk(base, obj, index, text, include_usage))
            finish = {"text": "", "finish_reason": choice.get("finish_reason", "stop")}
            chunks.append(_chunk(base, obj, index, finish, include_usage))
    if include_usage:
        chunks.append(_sse({**base, "object": obj, "choices": [], "usage": dict(ZERO_USAGE)}))
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def _chunk(
    base: Mapping[str, Any], obj: str, index: int, fields: Mapping[str, Any], with_usage: bool
) -> bytes:
    payload: dict[str, Any] = {**base, "object": obj, "choices": [{"index": index, **fields}]}
    if with_usage:
        payload["usage"] = None
    return _sse(payload)


def is_storable(response: Mapping[str, Any]) -> bool:
    """A complete, successful answer: every choice finished for a normal reason."""
    choices = response.get("choices")
    if "error" in response or not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, Mapping) and c.get("finish_reason") in _FINISHED for c in choices)


def assemble_stream(chunks: Iterable[Mapping[str, Any]], *, done: bool) -> dict[str, Any] | None:
    """The complete response a stream of chunk objects adds up to; None if it is unfinished.

    ``done`` says whether ``data: [DONE]`` arrived: a stream cut short is never stored.
    """
    if not done:
        return None
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    chat = True
    for chunk in chunks:
        if "error" in chunk:
            return None
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in head:
                head[key] = chunk[key]
        chat = chunk.get("object", "chat.completion.chunk") == "chat.completion.chunk"
        for part in chunk.get("choices") or []:
            slot = choices.setdefault(int(part.get("index", 0)), {"content": [], "tools": {}})
            if part.get("finish_reason"):
                slot["finish_reason"] = part["finish_reason"]
            if not chat:
                slot["content"].append(part.get("text") or "")
                continue
            delta = part.get("delta") or {}
            if delta.get("role"):
                slot["role"] = delta["role"]
            if delta.get("content"):
                slot["content"].append(delta["content"])
            for call in delta.get("tool_calls") or []:
                _merge_tool_call(slot["tools"], call)
    if not choices:
        return None
    out_choices = []
    for index in sorted(choices):
        slot = choices[index]
        text = "".join(slot["content"])
        finish = slot.get("finish_reason")
        if chat:
            message: dict[str, Any] = {"role": slot.get("role", "assistant"), "content": text}
            if slot["tools"]:
                message["tool_calls"] = [slot["tools"][i] for i in sorted(slot["tools"])]
                message["content"] = text or None
            out_choices.append({"index": index, "message": message, "finish_reason": finish})
        else:
            out_choices.append({"index": index, "text": text, "finish_reason": finish})
    result = {
        **head,
        "object": "chat.completion" if chat else "text_completion",
        "choices": out_choices,
    }
    return result if is_storable(result) else None


def _merge_tool_call(tools: dict[int, dict[str, Any]], call: Mapping[str, Any]) -> None:
    slot = tools.setdefault(
        int(call.get("index", 0)),
        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
    )
    if call.get("id"):
        slot["id"] = call["id"]
    if call.get("type"):
        slot["type"] = call["type"]
    function = call.get("function") or {}
    if function.get("name"):
        slot["function"]["name"] += function["name"]
    if function.get("arguments"):
        slot["function"]["arguments"] += function["arguments"]
