"""A Responses request's parameters other than its input, as chat-completions parameters:
function tools, ``tool_choice``, ``parallel_tool_calls``, ``text.format`` ->
``response_format``, ``max_output_tokens``, sampling, ``top_logprobs``, ``reasoning.effort``,
``user``. What does not map is a 400 naming the parameter (``gateway.protocol.responses``
lists the whole mapping).

``callers_error`` turns an upstream's refusal back into the caller's terms: an error about the
output limit names ``max_output_tokens``, the parameter the caller sent, not
``max_completion_tokens`` (what the gateway sent it as) or ``max_tokens`` (vLLM's name for both,
and the output cap's)."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.errors import BadRequest
from gateway.protocol import upstream_json

_TOOL_CHOICES = frozenset({"none", "auto", "required"})
_SENT_OUTPUT_LIMIT = frozenset({"max_completion_tokens", "max_tokens"})
# vLLM says "'max_tokens' or 'max_completion_tokens' is too large: 5000. ... (5000 > 4096 - 9).
# (parameter=max_tokens, value=5000)"
_EITHER_NAME = "'max_tokens' or 'max_completion_tokens'"
_SENT_NAME = re.compile(r"\bmax_(?:completion_)?tokens\b")


def chat_params(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions parameters ``body`` (a Responses request) asks for."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        out["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
    if isinstance(body.get("parallel_tool_calls"), bool) and tools:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BadRequest(
                "'max_output_tokens' must be a positive integer", param="max_output_tokens"
            )
        out["max_completion_tokens"] = limit
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequest(f"'{name}' must be a number", param=name)
            out[name] = value
    top = body.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0:
        out["logprobs"] = True
        out["top_logprobs"] = top
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise BadRequest("'reasoning' must be an object", param="reasoning")
    if reasoning and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    user = body.get("user") or body.get("safety_identifier")
    if isinstance(user, str) and user:
        out["user"] = user
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f"tools of type {kind!r} are not supported: only function tools are",
                param=f"{where}.type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BadRequest(f"'{where}.name' is required", param=f"{where}.name")
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        parameters = tool.get("parameters")
        function["parameters"] = (
            parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
        )
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise BadRequest(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequest("'text.format.schema' must be an object", param="text.format.schema")
        schema: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        for name in ("description", "strict"):
            if fmt.get(name) is not None:
                schema[name] = fmt[name]
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest(
        "'text.format.type' must be text, json_object or json_schema", param="text.format"
    )


def callers_error(raw: bytes) -> bytes:
    """An upstream's OpenAI-format error about the output limit, naming ``max_output_tokens``;
    any other error (or a body that is not one) as it came."""
    try:
        data = upstream_json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return raw
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return raw
    message, param = error.get("message"), error.get("param")
    about_limit = param in _SENT_OUTPUT_LIMIT or (
        isinstance(message, str) and "max_completion_tokens" in message
    )
    if not about_limit:
        return raw
    told = {**error}
    if param is None or param in _SENT_OUTPUT_LIMIT:
        told["param"] = "max_output_tokens"
    if isinstance(message, str):
        message = message.replace(_EITHER_NAME, "'max_output_tokens'")
        told["message"] = _SENT_NAME.sub("max_output_tokens", message)
    return json.dumps({**data, "error": told}).encode()
