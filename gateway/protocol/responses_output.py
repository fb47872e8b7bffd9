"""Chat-completion answers as Responses API ``response`` objects.

One chat choice becomes the output items, in the order a Responses model produces them: a
``reasoning`` item (from ``reasoning_content`` / ``reasoning``, when the backend returns its
reasoning; signed ``thinking_blocks`` sealed in its ``encrypted_content``:
``gateway.protocol.thinking``), a ``message`` item (``output_text``, or a ``refusal`` part), then one
``function_call`` item per tool call (``arguments`` an upstream sent as a JSON object, as HF
TGI does, become that object's JSON text). ``finish_reason: length`` makes the response
``incomplete`` with ``incomplete_details.reason: max_output_tokens`` (``content_filter`` the
same with that reason). Usage: ``input_tokens`` and ``input_tokens_details.cached_tokens``
from ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` (``cache_write_tokens`` 0:
chat backends do not report cache writes); ``output_tokens`` and
``output_tokens_details.reasoning_tokens`` from ``completion_tokens`` and
``completion_tokens_details.reasoning_tokens``; ``total_tokens`` their sum when the upstream
sent none.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gateway.protocol.answers import arguments_text
from gateway.protocol.responses import ResponsesRequest, new_id
from gateway.protocol.thinking import seal, signed_blocks

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def usage(counts: Mapping[str, Any] | None) -> dict[str, Any]:
    counts = counts or {}
    prompt = _int(counts.get("prompt_tokens"))
    completion = _int(counts.get("completion_tokens"))
    prompt_details = counts.get("prompt_tokens_details")
    completion_details = counts.get("completion_tokens_details")
    cached = _int(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = (
        _int(completion_details.get("reasoning_tokens"))
        if isinstance(completion_details, dict)
        else 0
    )
    total = counts.get("total_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": _int(total) if total is not None else prompt + completion,
    }


def _int(value: Any) -> int:
    """A count as the client may see it: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def dicts(value: Any) -> list[dict[str, Any]]:
    """The objects of a list an upstream sent (tool calls, choices...): nothing else of it."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def reasoning_text(message: Mapping[str, Any]) -> str | None:
    """The reasoning a backend returned beside the answer (vLLM: ``reasoning_content``, newer
    vLLM and others: ``reasoning``)."""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def reasoning_item(
    text: str,
    id_: str | None = None,
    status: str = "completed",
    blocks: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A reasoning item; ``blocks`` (signed thinking) sealed in its ``encrypted_content``."""
    item: dict[str, Any] = {
        "id": id_ or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }
    if blocks:
        item["encrypted_content"] = seal(blocks)
    return item


def logprobs(choice_logprobs: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries as Responses ``logprobs`` (the same token records)."""
    content = choice_logprobs.get("content") if isinstance(choice_logprobs, dict) else None
    out = []
    for entry in content if isinstance(content, list) else ():
        if not isinstance(entry, dict):
            continue
        top = [
            {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
            for t in dicts(entry.get("top_logprobs"))
        ]
        out.append(
            {
                "token": entry.get("token"),
                "logprob": entry.get("logprob"),
                "bytes": entry.get("bytes") or [],
                "top_logprobs": top,
            }
        )
    return out


def message_item(
    text: str,
    refusal: str | None = None,
    id_: str | None = None,
    status: str = "completed",
    token_logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text or refusal is None:
        part = {"type": "output_text", "text": text, "annotations": []}
        content.append({**part, "logprobs": token_logprobs or []})
    if refusal is not None:
        content.append({"type": "refusal", "refusal": refusal})
    return {
        "id": id_ or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    call_id: str, name: str, arguments: str, id_: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": id_ or new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: Mapping[str, Any], choice_logprobs: Any = None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    reasoning = reasoning_text(message)
    blocks = signed_blocks(message.get("thinking_blocks"))
    if reasoning is not None or blocks:
        items.append(reasoning_item(reasoning or "", blocks=blocks))
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    refusal = message.get("refusal") if isinstance(message.get("refusal"), str) else None
    calls = dicts(message.get("tool_calls"))
    if text or refusal is not None or not calls:
        items.append(message_item(text, refusal, token_logprobs=logprobs(choice_logprobs)))
    for call in calls:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        items.append(
            function_call_item(
                str(call.get("id") or new_id("call")),
                str(function.get("name") or ""),
                arguments_text(function.get("arguments")) or "",
            )
        )
    return items


def skeleton(
    request: ResponsesRequest, response_id: str, created_at: int | None = None
) -> dict[str, Any]:
    """The Response object before any output: what ``response.created`` carries."""
    echo = request.echo
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": request.model,
        "output": [],
        "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": echo.get("reasoning") or {"effort": None, "summary": None},
        "store": request.store,
        "temperature": echo.get("temperature"),
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "top_p": echo.get("top_p"),
        "truncation": echo.get("truncation", "disabled"),
        "usage": None,
        "user": echo.get("user"),
        "metadata": echo.get("metadata") or {},
    }


def finish(
    response: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: Any,
    counts: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``response`` completed (or incomplete) with ``output`` and usage; returns it."""
    reason = _INCOMPLETE.get(finish_reason) if isinstance(finish_reason, str) else None
    response["status"] = "incomplete" if reason else "completed"
    response["incomplete_details"] = {"reason": reason} if reason else None
    response["output"] = output
    response["usage"] = usage(counts)
    response["completed_at"] = int(time.time()) if reason is None else None
    return response


def from_chat_completion(
    answer: Mapping[str, Any], request: ResponsesRequest, response_id: str
) -> dict[str, Any]:
    """The Response object for a whole chat answer (its first choice: Responses has no ``n``)."""
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    response = skeleton(request, response_id, _created(answer))
    if isinstance(answer.get("model"), str):
        response["model"] = answer["model"]
    return finish(
        response,
        output_items(
            message if isinstance(message, dict) else {},
            choice.get("logprobs") if isinstance(choice, dict) else None,
        ),
        choice.get("finish_reason") if isinstance(choice, dict) else None,
        answer.get("usage") if isinstance(answer.get("usage"), dict) else None,
    )


def _created(answer: Mapping[str, Any]) -> int | None:
    created = answer.get("created")
    return created if isinstance(created, int) and created > 0 else None
