"""Anthropic Messages answers and errors, translated into OpenAI's chat-completion JSON.

Text blocks join into ``message.content``; thinking blocks into ``reasoning_content`` (as vLLM
reports reasoning), and, with their signatures, into ``thinking_blocks`` (LiteLLM's field:
``{type: thinking, thinking, signature}`` and ``{type: redacted_thinking, data}``), which a
client sends back on the assistant message so that a tool loop with thinking continues (the
request's translation rebuilds them); ``tool_use`` blocks become ``tool_calls`` (their ``input`` as a JSON string
of arguments), except the call of a structured answer's format tool, whose input is the
content; ``stop_reason`` maps onto ``finish_reason``; usage counts cached prompt tokens (read and written) into ``prompt_tokens``, as OpenAI does, and
reports the ones read under ``prompt_tokens_details.cached_tokens``; thinking tokens
(``output_tokens_details.thinking_tokens``) under ``completion_tokens_details.reasoning_tokens``; counts that are
missing or malformed give an answer without usage (charged its estimate). Server-tool blocks have no
OpenAI counterpart and are left out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from gateway.errors import error_body
from gateway.limits.cost import Usage, believed_count
from gateway.protocol import upstream_json

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

# Anthropic's token counts: the input apart from the cache's reads and writes, the output.
_COUNTS = (
    "input_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "output_tokens",
)

# Anthropic's error types, as OpenAI's (the original stays in ``code``).
_ERROR_TYPES = {
    "request_too_large": "invalid_request_error",
    "api_error": "upstream_error",
    "overloaded_error": "upstream_error",
}
_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def finish_reason(stop_reason: Any) -> str:
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def usage(counts: Any) -> dict[str, Any] | None:
    """Chat's usage for Anthropic's counts; None (the answer goes without one) when they are
    missing or malformed, so that it is charged its estimate as any upstream's that reports
    no usage (a zero would be charged as told)."""
    if not isinstance(counts, Mapping):
        return None
    told = Usage.read({key: counts[key] for key in _COUNTS if key in counts})
    if told is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": told.input,
        "completion_tokens": told.output,
        "total_tokens": told.total,
    }
    if told.input > counts["input_tokens"]:  # read from or written to the prompt cache
        out["prompt_tokens_details"] = {"cached_tokens": told.cached_input}
    details = counts.get("output_tokens_details")
    thinking = details.get("thinking_tokens") if isinstance(details, Mapping) else None
    if believed_count(thinking) and thinking:
        out["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return out


def thinking_block(thinking: str, signature: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": signature}


def text_field(block: Mapping[str, Any], key: str) -> str:
    """A field that chat clients read as a string (a tool call's id, its name), else ""."""
    value = block.get(key)
    return value if isinstance(value, str) else ""


def chat_completion(
    message: Mapping[str, Any], created: int | None = None, format_tool: str | None = None
) -> dict[str, Any]:
    """The ``chat.completion`` for an Anthropic ``message``; raises ValueError if it is none.

    ``format_tool``: the tool that carries a structured answer (``anthropic_options``); its
    input is the message's content. Thinking becomes ``reasoning_content``.
    """
    if message.get("type") != "message" or not isinstance(message.get("content"), list):
        raise ValueError("not an Anthropic message")
    texts: list[str] = []
    thoughts: list[str] = []
    signed: list[dict[str, Any]] = []  # thinking_blocks
    calls: list[dict[str, Any]] = []
    for block in message["content"]:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
            if isinstance(block.get("signature"), str):
                signed.append(thinking_block(block["thinking"], block["signature"]))
        elif kind == "redacted_thinking" and isinstance(block.get("data"), str):
            signed.append({"type": "redacted_thinking", "data": block["data"]})
        elif kind == "tool_use" and format_tool is not None and block.get("name") == format_tool:
            texts.append(json.dumps(block.get("input") or {}))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": text_field(block, "id"),
                    "type": "function",
                    "function": {
                        "name": text_field(block, "name"),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if thoughts:
        reply["reasoning_content"] = "".join(thoughts)
    if signed:
        reply["thinking_blocks"] = signed
    if calls:
        reply["tool_calls"] = calls
    elif reply["content"] is None:
        reply["content"] = ""
    stop = message.get("stop_reason")
    if stop == "tool_use" and not calls:
        stop = "end_turn"  # the only tool called was the answer's format
    answer: dict[str, Any] = {
        "id": message.get("id"),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": message.get("model"),
        "choices": [
            {
                "index": 0,
                "message": reply,
                "finish_reason": finish_reason(stop),
                "logprobs": None,
            }
        ],
    }
    counts = usage(message.get("usage"))
    if counts is not None:
        answer["usage"] = counts
    return answer


def openai_error(status: int, raw: bytes) -> dict[str, Any]:
    """OpenAI's error JSON for an Anthropic error body (or for whatever answered instead)."""
    kind, message = None, None
    try:
        data = upstream_json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") if isinstance(error.get("type"), str) else None
        message = error.get("message") if isinstance(error.get("message"), str) else None
    type_ = _ERROR_TYPES.get(kind or "", kind) or _STATUS_TYPES.get(status, "invalid_request_error")
    return error_body(message or f"the Anthropic API answered {status}", type_, kind)


def translate_body(status: int, raw: bytes, format_tool: str | None = None) -> tuple[int, bytes]:
    """A whole answer: the status and OpenAI body to relay. A 200 that is no message (an error
    object, a page) raises ``ValueError``: the reader takes it as the replica's unreadable
    answer (outcome ``bad_answer``, a 502), as it takes any other."""
    if status != 200:
        return status, json.dumps(openai_error(status, raw)).encode()
    try:
        data = upstream_json.loads(raw)
        return 200, json.dumps(chat_completion(data, format_tool=format_tool)).encode()
    except (UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise ValueError("the Anthropic API answered 200 without a message") from exc
