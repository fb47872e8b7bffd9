"""Chat-completion answers and gateway errors in the Anthropic Messages API's format.

A chat choice becomes content blocks in the order Claude produces them: ``thinking`` (from the
backend's ``reasoning_content`` / ``reasoning``, with an empty signature: it was not signed by
Anthropic), ``text``, then one ``tool_use`` block per tool call (its arguments parsed into
``input``, or taken as they are when the upstream sent an object, as HF TGI does; arguments that
are not a JSON object are kept under ``{"arguments": ...}`` rather than lost). ``finish_reason``
maps onto ``stop_reason``: stop -> ``end_turn``, or ``stop_sequence`` when the backend says
which of the request's ``stop_sequences`` matched (vLLM's ``stop_reason``); length ->
``max_tokens``; tool_calls -> ``tool_use``; content_filter -> ``refusal``.

Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from a cache,
``cache_read_input_tokens`` those read from one (``prompt_tokens_details.cached_tokens``),
``cache_creation_input_tokens`` 0 (chat backends do not report writes), ``output_tokens``, and
``output_tokens_details.thinking_tokens`` from ``completion_tokens_details.reasoning_tokens``.

Errors: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's error types and
statuses; the gateway's 503 (no healthy replica, admission) is Anthropic's 529
``overloaded_error``, which its clients retry.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from gateway.errors import BadRequest
from gateway.protocol import upstream_json
from gateway.protocol.responses_output import dicts, reasoning_text

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STATUSES = {503: 529}  # the gateway's status -> Anthropic's


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(counts: Mapping[str, Any] | None) -> dict[str, Any]:
    counts = counts or {}
    prompt = _int(counts.get("prompt_tokens"))
    details = counts.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    cached = min(cached, prompt)
    out: dict[str, Any] = {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": _int(counts.get("completion_tokens")),
    }
    output = counts.get("completion_tokens_details")
    thinking = _int(output.get("reasoning_tokens")) if isinstance(output, dict) else 0
    if thinking:
        out["output_tokens_details"] = {"thinking_tokens": thinking}
    return out


def _int(value: Any) -> int:
    """A count as the client may see it: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def stop_reason(
    finish_reason: Any, matched: Any, stop_sequences: tuple[str, ...]
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat ``finish_reason`` and vLLM's ``stop_reason``."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return STOP_REASONS.get(
        finish_reason if isinstance(finish_reason, str) else "", "end_turn"
    ), None


def tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    if not isinstance(arguments, str):
        return {"arguments": arguments}
    if not arguments.strip():
        return {}
    try:
        value = upstream_json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    if reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    content = message.get("content")
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        blocks.append({"type": "text", "text": refusal})
    for call in dicts(message.get("tool_calls")):
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        blocks.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                "name": str(function.get("name") or ""),
                "input": tool_input(function.get("arguments")),
            }
        )
    return blocks


def from_chat_completion(
    answer: Mapping[str, Any],
    model: str,
    stop_sequences: tuple[str, ...] = (),
    message_id: str | None = None,
) -> dict[str, Any]:
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences
    )
    counts = answer.get("usage")
    return {
        "id": message_id or new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": answer.get("model") if isinstance(answer.get("model"), str) else model,
        "content": content_blocks(message or {}),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(counts if isinstance(counts, dict) else None),
    }


# --- errors ----------------------------------------------------------------------------------


def error_status(status: int) -> int:
    return _STATUSES.get(status, status)


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for a response of ``status`` (already mapped)."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(status: int, raw: bytes) -> tuple[int, bytes]:
    """An OpenAI-format error (the gateway's or an upstream's) as Anthropic's."""
    message = None
    try:
        data = upstream_json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message = error["message"]
    elif isinstance(data, dict) and isinstance(data.get("message"), str):
        message = data["message"]  # the flat form of older vLLM and other OpenAI-like servers
    mapped = error_status(status)
    body = error_body(mapped, message or f"the upstream answered {status}")
    return mapped, json.dumps(body).encode()


# --- models ----------------------------------------------------------------------------------


LIFECYCLES = ("active", "deprecated", "retired")
_PAGE = (1, 20, 1000)  # limit: least, default, most (as Anthropic's API)


def model_object(name: str) -> dict[str, Any]:
    """``GET /v1/models/{name}`` as Anthropic describes a model (every one served is active)."""
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
        "lifecycle": "active",
    }


def models_page(
    names: list[str],
    limit: str | None = None,
    after_id: str | None = None,
    before_id: str | None = None,
    lifecycles: list[str] | None = None,
) -> dict[str, Any]:
    """``GET /v1/models`` as Anthropic pages it: ``limit`` models (20 unless asked, 1 to 1,000)
    after ``after_id`` or before ``before_id``; ``has_more`` says whether more lie that way, and
    ``first_id`` / ``last_id`` are the cursors of the pages before and after. ``lifecycle``
    filters by stage (every model served is active). A parameter out of range, or a cursor
    naming no model, is a 400 naming it."""
    size = _limit(limit)
    if after_id is not None and before_id is not None:
        raise BadRequest("after_id and before_id cannot both be given", param="before_id")
    for stage in lifecycles or ():
        if stage not in LIFECYCLES:
            raise BadRequest("lifecycle: must be active, deprecated or retired", param="lifecycle")
    if lifecycles and "active" not in lifecycles:
        names = []
    if before_id is not None:
        end = _position(names, before_id, "before_id")
        start = max(0, end - size)
        has_more = start > 0
    else:
        start = 0 if after_id is None else _position(names, after_id, "after_id") + 1
        end = start + size
        has_more = end < len(names)
    page = names[start:end]
    return {
        "data": [model_object(name) for name in page],
        "has_more": has_more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


def _limit(value: str | None) -> int:
    least, default, most = _PAGE
    if value is None:
        return default
    if not value.isascii() or not value.isdigit() or not least <= int(value) <= most:
        raise BadRequest(f"limit: must be an integer from {least} to {most}", param="limit")
    return int(value)


def _position(names: list[str], name: str, param: str) -> int:
    try:
        return names.index(name)
    except ValueError:
        raise BadRequest(f"{param}: no model '{name}' is listed", param=param) from None
