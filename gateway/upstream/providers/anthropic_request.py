"""An OpenAI chat-completions request, translated into an Anthropic Messages request.

What maps: ``system`` and ``developer`` messages become the top-level ``system`` (one text block
per text, in order, wherever they stood); user and assistant text and image parts become content
blocks (a ``data:`` URL a base64 source, an http(s) URL a url source); an assistant's
``tool_calls`` become ``tool_use`` blocks, and ``tool`` messages ``tool_result`` blocks of a user
turn (consecutive turns of one role are merged into one, as the Messages API alternates roles);
an assistant's ``thinking_blocks`` (as answers carry them: ``anthropic_response``) become its
turn's first blocks, signatures kept, as Anthropic needs them to continue a tool loop with
thinking; ``tools``; ``tool_choice`` auto / none / required / a function -> auto / none / any / tool
(``parallel_tool_calls: false`` -> ``disable_parallel_tool_use``); ``max_completion_tokens`` or
``max_tokens`` (the backend's ``default_max_tokens`` when neither is given: Anthropic requires
one); ``temperature`` (0 to 1 there), ``top_p``, ``top_k``; ``stop`` -> ``stop_sequences``;
``user`` -> ``metadata.user_id``; ``stream``.

``response_format`` (json_schema, json_object), ``reasoning_effort``, PDF ``file`` parts and
``cache_control`` markers: ``anthropic_options``.

What Anthropic cannot honour answers 400 naming the field, before anything is sent, rather than
be dropped and change the answer's meaning: ``n`` above 1, ``logprobs`` / ``top_logprobs``,
``logit_bias``, non-zero presence or frequency penalties,
audio output, the legacy ``functions`` / ``function_call``, a ``temperature`` above 1, content
parts other than text, images and PDF files, roles other than system, developer, user, assistant and tool.
Fields that do not change what a correct answer is (``seed``, ``store``, ``metadata``,
``service_tier``, ``prediction``, ``stream_options``...) and vendor extras are dropped.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest
from gateway.protocol import upstream_json
from gateway.protocol.thinking import signed_blocks
from gateway.upstream.providers.anthropic_options import (
    document,
    structured_output,
    thinking,
    with_cache_marker,
)

_THINKING_TYPES = ("thinking", "redacted_thinking")
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "auto": {"type": "auto"},
    "none": {"type": "none"},
    "required": {"type": "any"},
}


def unsupported(what: str, param: str) -> BadRequest:
    return BadRequest(f"{what} is not supported by Anthropic backends", param=param)


def to_messages_request(
    body: dict[str, Any], model: str, default_max_tokens: int, cap: int | None = None
) -> dict[str, Any]:
    """The Messages request for ``body`` (already checked by ``gateway.protocol``).

    ``cap`` is the gateway's output cap (``cap_output``), applied over the client's own limit.
    """
    _reject_unsupported(body)
    system, messages = _messages(body["messages"])
    max_tokens, limit = _max_tokens(body, default_max_tokens, cap)
    out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": messages}
    if system:
        out["system"] = system
    tools = body.get("tools")
    if tools:
        out["tools"] = _tools(tools)
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            out["tool_choice"] = choice
    stop = _stop(body.get("stop"))
    if stop:
        out["stop_sequences"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    user = body.get("user")
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user}
    if body.get("stream"):
        out["stream"] = True
    if not _unsigned_tool_loop(messages):
        # Anthropic refuses thinking when the tool loop being continued did not start with its
        # thinking block (a client that kept no thinking_blocks): the turn goes without.
        thinking(body, out, limit)  # before the format tool: with thinking, none is forced
    structured_output(body, out)
    return out


def _reject_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise unsupported("'n' other than 1", "n")
    if body.get("logprobs"):
        raise unsupported("'logprobs'", "logprobs")
    if body.get("top_logprobs"):
        raise unsupported("'top_logprobs'", "top_logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (
        isinstance(fmt, dict) and fmt.get("type") in ("text", "json_schema", "json_object")
    ):
        raise unsupported(
            "'response_format' other than text, json_schema and json_object", "response_format"
        )
    if body.get("logit_bias"):
        raise unsupported("'logit_bias'", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise unsupported(f"a non-zero '{name}'", name)
    if body.get("audio") is not None:
        raise unsupported("audio output", "audio")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("output modalities other than text", "modalities")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise unsupported(f"the legacy '{name}' (use 'tools')", name)
    temperature = body.get("temperature")
    if temperature is not None and temperature > 1:
        raise BadRequest(
            "'temperature' must be between 0 and 1 for Anthropic backends", param="temperature"
        )


def _max_tokens(body: dict[str, Any], default: int, cap: int | None) -> tuple[int, int | None]:
    """``max_tokens`` for the answer, and the limit of the whole output (thinking included):
    the client's (OpenAI counts reasoning in it) or ``cap``, the smaller; None without one."""
    requested = body.get("max_completion_tokens")
    if requested is None:
        requested = body.get("max_tokens")
    value = default if requested is None else requested
    if value < 1:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise BadRequest(f"'{name}' must be at least 1", param=name)
    limits = [n for n in (requested, cap) if n is not None]
    return (value if cap is None else min(value, cap)), min(limits) if limits else None


# --- messages ------------------------------------------------------------------------------


def _messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message["role"]
        if role in ("system", "developer"):
            system.extend(_text_blocks(message.get("content"), where))
        elif role == "user":
            _append(turns, "user", _user_blocks(message.get("content"), where))
        elif role == "assistant":
            _append(turns, "assistant", _assistant_blocks(message, where))
        elif role == "tool":
            _append(turns, "user", [_tool_result(message, where)])
        else:
            raise unsupported(f"the role {role!r}", f"{where}.role")
    return system, turns


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return  # an empty turn (no text, no tool call) carries nothing and Anthropic refuses it
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Text content (a string, or text parts); empty texts are left out (Anthropic refuses them)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks = []
    for j, part in enumerate(content):
        text = _part_text(part, f"{where}.content[{j}]")
        if text:
            blocks.append(with_cache_marker(part, {"type": "text", "text": text}))
    return blocks


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in ("text", "refusal"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise unsupported(f"a content part of type {kind!r} here", where)
    text = part.get(part["type"])
    if not isinstance(text, str):
        raise BadRequest(f"'{where}.{part['type']}' must be a string", param=where)
    return text


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return _text_blocks(content, where)
    blocks = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "image_url":
            blocks.append(with_cache_marker(part, _image(part.get("image_url"), at)))
        elif isinstance(part, dict) and part.get("type") == "file":
            blocks.append(document(part, at))
        else:
            text = _part_text(part, at)
            if text:
                blocks.append(with_cache_marker(part, {"type": "text", "text": text}))
    return blocks


def _image(image: Any, where: str) -> dict[str, Any]:
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise BadRequest(f"'{where}.image_url.url' must be a string", param=where)
    if url.startswith("data:"):
        header, _, data = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if encoding != "base64" or media_type not in _IMAGE_TYPES or not data:
            raise unsupported(
                "an image data URL other than base64 JPEG, PNG, GIF or WebP", f"{where}.image_url"
            )
        source = {"type": "base64", "media_type": media_type, "data": data}
    elif url.startswith(("https://", "http://")):
        source = {"type": "url", "url": url}
    else:
        raise unsupported("an image URL that is neither data: nor http(s):", f"{where}.image_url")
    return {"type": "image", "source": source}


def _assistant_blocks(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    blocks = [
        *signed_blocks(message.get("thinking_blocks")),
        *_text_blocks(message.get("content"), where),
    ]
    calls = message.get("tool_calls")
    if calls is None:
        return blocks
    if not isinstance(calls, list):
        raise BadRequest(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    for k, call in enumerate(calls):
        blocks.append(_tool_use(call, f"{where}.tool_calls[{k}]"))
    return blocks


def _unsigned_tool_loop(turns: list[dict[str, Any]]) -> bool:
    """The request continues a tool loop (its last turn holds tool results) whose first
    assistant turn, after the user's own last turn, does not start with a thinking block."""
    if not turns or turns[-1]["role"] != "user" or not _has_results(turns[-1]):
        return False
    first = None
    for turn in reversed(turns):
        if turn["role"] == "user" and not _has_results(turn):
            break  # the user's own turn: the loop began after it
        if turn["role"] == "assistant":
            first = turn
    return first is not None and first["content"][0]["type"] not in _THINKING_TYPES


def _has_results(turn: dict[str, Any]) -> bool:
    return any(block["type"] == "tool_result" for block in turn["content"])


def _tool_use(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str):
        raise BadRequest(f"'{where}' needs an 'id' and a 'function'", param=where)
    if call.get("type", "function") != "function":
        raise unsupported(f"a tool call of type {call.get('type')!r}", f"{where}.type")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"'{where}.function.name' must be a string", param=f"{where}.function.name"
        )
    arguments = function.get("arguments") or "{}"
    try:
        args = upstream_json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise BadRequest(
            f"'{where}.function.arguments' must be a JSON object in a string",
            param=f"{where}.function.arguments",
        )
    return {"type": "tool_use", "id": call["id"], "name": name, "input": args}


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"'{where}.tool_call_id' is required", param=f"{where}.tool_call_id")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    texts = _text_blocks(message.get("content"), where)
    if texts:
        block["content"] = texts
    return block


# --- tools ---------------------------------------------------------------------------------


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise unsupported("a tool other than a function", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"'{where}.function.name' is required", param=f"{where}.function")
        spec: dict[str, Any] = {"name": function["name"]}
        if isinstance(function.get("description"), str):
            spec["description"] = function["description"]
        parameters = function.get("parameters")
        spec["input_schema"] = (
            parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
        )
        out.append(spec)
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if choice is None:
        out = None
    elif isinstance(choice, str) and choice in _TOOL_CHOICES:
        out = dict(_TOOL_CHOICES[choice])
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise BadRequest(
            "'tool_choice' must be auto, none, required or a function", param="tool_choice"
        )
    if parallel is False and (out is None or out["type"] != "none"):
        out = out or {"type": "auto"}
        out["disable_parallel_tool_use"] = True
    return out


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadRequest("'stop' must be a string or an array of strings", param="stop")
