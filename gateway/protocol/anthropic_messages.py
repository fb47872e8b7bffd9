"""An Anthropic Messages API request, read and translated into a chat-completions request.

What maps:

- ``system`` (a string or text blocks) -> a leading system message;
- user content blocks: ``text``; ``image`` (base64 -> a ``data:`` URL, url -> its URL);
  ``document`` (a base64 PDF -> a chat ``file`` part with a ``data:`` URL, a plain-text source
  -> text); ``tool_result`` blocks -> ``tool`` messages, placed before the turn's other content
  (Anthropic puts them first in the user turn, the chat API wants them right after the
  assistant's tool calls); ``is_error`` results are prefixed ``Error:`` (the chat API has no
  flag for it);
- assistant content blocks: ``text``; ``tool_use`` -> ``tool_calls`` (``input`` as a JSON
  string); ``thinking`` and ``redacted_thinking`` are left out (the chat API cannot send
  reasoning back; on a ``kind: anthropic`` backend the request goes through untranslated and
  keeps them);
- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``) -> function tools;
  ``tool_choice`` auto / any / tool / none -> auto / required / a function / none, and
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
- ``max_tokens`` (required, as Anthropic requires it), ``stop_sequences`` -> ``stop``,
  ``temperature``, ``top_p``, ``top_k``, ``metadata.user_id`` -> ``user``;
- ``thinking: {type: enabled, budget_tokens}`` -> ``reasoning_effort`` (under 4,096 tokens low,
  under 16,384 medium, else high); ``output_config.effort`` -> ``reasoning_effort``;
  ``output_config.format`` (``json_schema``) -> ``response_format``;
- ``stream`` (the usage chunk is always asked for: ``message_delta`` carries usage).

Answered 400 naming the parameter: server tools (web search, code execution, bash...), block
types other than the above, document sources other than base64 PDF and plain text, images in
a ``tool_result``, ``mcp_servers``, ``container``. ``cache_control`` (on blocks, or at the top
level) is accepted and not sent (a chat backend caches prefixes by itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.protocol import strict_json

_SERVER_TOOL = "server tools (such as web search or code execution) are not supported"
_REJECTED = ("mcp_servers", "container")
# Every top-level parameter the translation reads (or accepts without effect on the answer:
# service_tier, and cache_control, the automatic prompt caching of anthropic's clients); any
# other is refused by name, as Anthropic does, never dropped without a word.
_KNOWN = frozenset(
    {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
     "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "output_config",
     "service_tier", "cache_control", *_REJECTED}
)  # fmt: skip


@dataclass(slots=True)
class MessagesRequest:
    model: str
    stream: bool
    chat: dict[str, Any]  # the chat-completions request
    stop_sequences: tuple[str, ...]  # to tell stop_sequence from end_turn in the answer

    @property
    def prefill(self) -> bool:
        """The last message is the assistant's: the answer continues its text."""
        messages = self.chat["messages"]
        return bool(messages) and messages[-1].get("role") == "assistant"


def parse_messages_request(raw: bytes) -> MessagesRequest:
    body = strict_json.loads(raw)  # a 400 for anything but strict UTF-8 JSON
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return read_messages_request(body)


def read_messages_request(body: dict[str, Any], count_only: bool = False) -> MessagesRequest:
    """``count_only``: a count_tokens request (no ``max_tokens``, never streamed)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: Field required", param="model")
    for name in _REJECTED:
        if body.get(name):
            raise BadRequest(f"'{name}' is not supported", param=name)
    for name in body:
        if name not in _KNOWN:
            raise BadRequest(f"{name}: Extra inputs are not permitted", param=name)
    messages = _system(body.get("system"))
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages: a non-empty array is required", param="messages")
    for i, message in enumerate(raw_messages):
        messages.extend(_message(message, f"messages.{i}"))
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if not count_only:
        chat["max_tokens"] = _max_tokens(body.get("max_tokens"))
    stop = _stop_sequences(body.get("stop_sequences"))
    if stop:
        chat["stop"] = list(stop)
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequest(f"{name}: must be a number", param=name)
            chat[name] = value
    tools = body.get("tools")
    if tools:
        chat["tools"] = _tools(tools)
    _tool_choice(body.get("tool_choice"), chat)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    _reasoning(body, chat)
    stream = body.get("stream", False) is True and not count_only
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return MessagesRequest(model, stream, chat, stop)


def _max_tokens(value: Any) -> int:
    if value is None:
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest("max_tokens: must be a positive integer", param="max_tokens")
    return value


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop_sequences: must be an array of strings", param="stop_sequences")
    return tuple(value)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        texts = []
        for k, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise BadRequest("system: only text blocks are allowed", param=f"system.{k}")
            texts.append(_text(block, f"system.{k}"))
        return [{"role": "system", "content": "\n".join(texts)}] if texts else []
    raise BadRequest("system: must be a string or an array of text blocks", param="system")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.text: must be a string", param=f"{where}.text")
    return text


# --- messages --------------------------------------------------------------------------------


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict):
        raise BadRequest(f"{where}: must be an object", param=where)
    role = message.get("role")
    content = message.get("content")
    if role not in ("user", "assistant"):
        raise BadRequest(f"{where}.role: must be user or assistant", param=f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content: must be a string or an array of blocks", param=f"{where}.content"
        )
    if role == "assistant":
        return [_assistant(content, where)]
    return _user(content, where)


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block.get("source"), at))
        elif kind == "document":
            parts.append(_document(block.get("source"), block, at))
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise BadRequest(
                f"{at}: content blocks of type {kind!r} are not supported in a user turn",
                param=f"{at}.type",
            )
    out = results
    if parts:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _image(source: Any, where: str) -> dict[str, Any]:
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if (
        isinstance(source, dict)
        and source.get("type") == "url"
        and isinstance(source.get("url"), str)
    ):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise BadRequest(
        f"{where}.source: an image source must be base64 data or a url", param=f"{where}.source"
    )


def _document(source: Any, block: dict[str, Any], where: str) -> dict[str, Any]:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        data = source.get("data")
        if source.get("media_type") == "application/pdf" and isinstance(data, str):
            file: dict[str, Any] = {"file_data": f"data:application/pdf;base64,{data}"}
            title = block.get("title")
            file["filename"] = title if isinstance(title, str) and title else "document.pdf"
            return {"type": "file", "file": file}
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    raise BadRequest(
        f"{where}.source: documents must be base64 PDF or plain text", param=f"{where}.source"
    )


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}.tool_use_id: Field required", param=f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    f"{where}.content.{k}: only text is supported in a tool_result",
                    param=f"{where}.content.{k}.type",
                )
            texts.append(_text(part, f"{where}.content.{k}"))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content: must be a string or blocks", param=f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            assert isinstance(block, dict)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadRequest(f"{at}: a tool_use block needs an id and a name", param=at)
            arguments = json.dumps(block.get("input") or {})
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise BadRequest(
                f"{at}: content blocks of type {kind!r} are not supported in an assistant turn",
                param=f"{at}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


# --- tools and the rest ----------------------------------------------------------------------


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools: must be an array", param="tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools.{k}"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            raise BadRequest(f"{where}: {_SERVER_TOOL}", param=f"{where}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}.name: Field required", param=f"{where}.name")
        if not isinstance(schema, dict):
            raise BadRequest(f"{where}.input_schema: Field required", param=f"{where}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise BadRequest("tool_choice: must be auto, any, tool or none", param="tool_choice")
    if choice.get("disable_parallel_tool_use") and "tools" in chat:
        chat["parallel_tool_calls"] = False


def effort_for_budget(budget: int) -> str:
    """A thinking budget as a reasoning effort: the inverse of the Anthropic egress mapping."""
    if budget < 4096:
        return "low"
    if budget < 16384:
        return "medium"
    return "high"


def _reasoning(body: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BadRequest(
                "thinking.budget_tokens: must be a positive integer",
                param="thinking.budget_tokens",
            )
        chat["reasoning_effort"] = effort_for_budget(budget)
    config = body.get("output_config")
    if not isinstance(config, dict):
        return
    if isinstance(config.get("effort"), str):
        chat["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise BadRequest(
            "output_config.format: only json_schema is supported", param="output_config.format"
        )
    if not isinstance(fmt.get("schema"), dict):
        raise BadRequest(
            "output_config.format.schema: Field required", param="output_config.format.schema"
        )
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True},
    }
