"""An OpenAI Responses API request, read and translated into a chat-completions request.

What maps, field by field:

- ``input``: a string is one user message; items are, in order, messages (roles user, system,
  developer, assistant; parts ``input_text``, ``input_image`` with an ``image_url``,
  ``input_file`` with ``file_data``, an assistant's ``output_text`` and ``refusal``),
  ``function_call`` items (consecutive ones become the ``tool_calls`` of one assistant message)
  and ``function_call_output`` items (``tool`` messages: ``input_text`` parts only, as a chat
  tool message holds text). A message's text parts are joined by a line break, as vLLM joins
  them and Messages does. ``reasoning`` items are left out (the chat API has no way to send
  reasoning back), except the signed thinking an Anthropic backend gave, which the gateway
  sealed in ``encrypted_content``: it becomes the next assistant message's ``thinking_blocks``
  (``gateway.protocol.thinking``), sent to Anthropic backends only.
- ``instructions``: a leading system message (not carried over by ``previous_response_id``,
  as OpenAI documents);
- ``tools``: function tools (``name``, ``description``, ``parameters``, ``strict``);
  ``tool_choice`` none / auto / required / ``{"type": "function", "name"}``;
  ``parallel_tool_calls``;
- ``text.format``: ``json_schema`` and ``json_object`` -> ``response_format``;
- ``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``; ``top_p``;
  ``top_logprobs`` -> ``logprobs`` + ``top_logprobs``; ``reasoning.effort`` ->
  ``reasoning_effort``; ``user`` (or ``safety_identifier``) -> ``user``; ``stream`` (the
  usage chunk is always asked for: the final ``response.completed`` carries usage).

Answered 400 naming the parameter: tools other than functions (web search, file search, computer
use, MCP...), ``tool_choice`` other than the above, items other than the above
(``item_reference`` included), ``background: true``, ``conversation``, ``prompt`` templates,
image or file inputs given by ``file_id``, images and files in a ``function_call_output``.
Fields that do not change what a correct answer is (``include``, ``truncation``, ``metadata``,
``service_tier``, ``prompt_cache_key``, ``text.verbosity``, ``reasoning.summary``,
``max_tool_calls``...) are accepted and not sent upstream; ``metadata`` and the rest of the
request are echoed in the Response object. ``store`` and ``previous_response_id`` are the
caller's: it prepends the stored conversation (``ResponsesRequest.chat_body(history)``) and
stores the answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest
from gateway.protocol import strict_json
from gateway.protocol.responses_params import chat_params
from gateway.protocol.thinking import unseal

_ROLES = frozenset({"user", "system", "developer", "assistant"})
_REJECTED = {
    "conversation": "'conversation' objects are not supported: use previous_response_id",
    "prompt": "prompt templates ('prompt') are not supported",
}


# Every top-level parameter the translation reads, accepts without effect on the answer (the
# README's table), or refuses with its own message; any other is refused by name, as OpenAI
# does ("Unknown parameter"), never dropped without a word.
_KNOWN = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
     "max_output_tokens", "temperature", "top_p", "top_logprobs", "reasoning", "user",
     "safety_identifier", "stream", "stream_options", "store", "previous_response_id", "include",
     "truncation", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
     "max_tool_calls", "background", *_REJECTED}
)  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses request: its chat translation and what the Response echoes."""

    model: str
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    items: list[dict[str, Any]]  # this request's input items, normalised, each with an id
    messages: list[dict[str, Any]]  # the same items as chat messages
    params: dict[str, Any]  # the chat request's other fields
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the Response repeats

    def chat_body(self, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The chat request: instructions, the stored conversation, then this input."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(history or ())
        messages.extend(self.messages)
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.params}
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def relayed_request(model: str, stream: bool, store: bool) -> ResponsesRequest:
    """A request relayed untranslated (``responses: passthrough``): the upstream reads it.
    ``store``: the upstream keeps the response (the gateway then records whose it is)."""
    return ResponsesRequest(model, stream, store, None, None, [], [], {})


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    body = strict_json.loads(raw)  # a 400 for anything but strict UTF-8 JSON
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return read_responses_request(body)


def read_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    for name, message in _REJECTED.items():
        if body.get(name) is not None:
            raise BadRequest(message, param=name)
    for name in body:
        if name not in _KNOWN:
            raise BadRequest(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
    if body.get("background"):
        raise BadRequest("background responses are not supported", param="background")
    stream = _flag(body, "stream", False)
    store = _flag(body, "store", True)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    items = _items(body.get("input"))
    if not items and previous is None:
        raise BadRequest("'input' is required", param="input")
    params = chat_params(body)
    echo = {
        name: body[name]
        for name in ("metadata", "reasoning", "text", "truncation", "user", "tool_choice")
        if body.get(name) is not None
    }
    echo["tools"] = body.get("tools") or []
    for name in ("temperature", "top_p", "max_output_tokens", "parallel_tool_calls"):
        echo[name] = body.get(name)
    return ResponsesRequest(
        model=model,
        stream=stream,
        store=store,
        previous_response_id=previous,
        instructions=instructions,
        items=items,
        messages=input_messages(items),
        params=params,
        echo=echo,
    )


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


# --- input items -----------------------------------------------------------------------------


def _items(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list):
        raise BadRequest("'input' must be a string or an array of items", param="input")
    items = [_item(item, f"input[{i}]") for i, item in enumerate(value)]
    seen: set[str] = set()
    for i, item in enumerate(items):  # an id names one item (input_items pages by it)
        if item["id"] in seen:
            raise BadRequest(
                f"Duplicate item found with id {item['id']}. Remove the duplicate item and try "
                "again.",
                param=f"input[{i}].id",
            )
        seen.add(item["id"])
    return items


def _message(role: str, content: list[dict[str, Any]], id_: str | None = None) -> dict[str, Any]:
    return {
        "id": id_ or new_id("msg"),
        "type": "message",
        "role": role,
        "content": content,
        "status": "completed",
    }


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise BadRequest(f"'{where}' must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequest(
                f"'{where}.role' must be one of user, system, developer, assistant",
                param=f"{where}.role",
            )
        return _message(role, _parts(item.get("content"), role, where), _str_or_none(item, "id"))
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise BadRequest(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
        return {
            "id": _str_or_none(item, "id") or new_id("fc"),
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise BadRequest(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise BadRequest(f"'{where}.output' must be a string or parts", param=f"{where}.output")
        if isinstance(output, list):
            _output_parts(output, f"{where}.output")
        return {
            "id": _str_or_none(item, "id") or new_id("fco"),
            "type": "function_call_output",
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        return {**item, "id": _str_or_none(item, "id") or new_id("rs")}
    raise BadRequest(
        f"input items of type {kind!r} are not supported (supported: message, function_call, "
        "function_call_output, reasoning)",
        param=f"{where}.type",
    )


def _output_parts(parts: list[Any], where: str) -> None:
    """A ``function_call_output``'s parts: text only, as a chat ``tool`` message holds it."""
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file"):
            raise BadRequest(
                f"'{at}': images and files in a function_call_output are not supported (the "
                "chat API's tool message holds text only): send them in a user message",
                param=at,
            )
        if kind != "input_text":
            raise BadRequest(
                f"function_call_output parts of type {kind!r} are not supported (supported: "
                "input_text)",
                param=f"{at}.type" if isinstance(part, dict) else at,
            )
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"'{at}.text' must be a string", param=f"{at}.text")


def _str_or_none(item: dict[str, Any], name: str) -> str | None:
    value = item.get(name)
    return value if isinstance(value, str) and value else None


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        part: dict[str, Any] = {"type": text_type, "text": content}
        if role == "assistant":
            part["annotations"] = []
        return [part]
    if not isinstance(content, list):
        raise BadRequest(
            f"'{where}.content' must be a string or an array of parts", param=f"{where}.content"
        )
    allowed = (
        ("output_text", "refusal", "input_text")
        if role == "assistant"
        else ("input_text", "input_image", "input_file")
    )
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise BadRequest(
                f"content parts of type {kind!r} are not supported in a {role} message",
                param=f"{at}.type",
            )
        if kind in ("input_image", "input_file") and part.get("file_id"):
            raise BadRequest("inputs given by 'file_id' are not supported", param=f"{at}.file_id")
        value_key = {"refusal": "refusal", "input_image": "image_url", "input_file": "file_data"}
        key = value_key.get(kind, "text")
        if not isinstance(part.get(key), str):
            raise BadRequest(f"'{at}.{key}' must be a string", param=f"{at}.{key}")
    return list(content)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for normalised Responses items (input or output items alike). A
    reasoning item's signed thinking (``gateway.protocol.thinking``) goes on the assistant
    message that follows it, as ``thinking_blocks``; other reasoning is left out."""
    messages: list[dict[str, Any]] = []
    thinking: list[dict[str, Any]] = []  # signed blocks waiting for their assistant turn
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thinking.extend(unseal(item.get("encrypted_content")))
            continue
        if kind == "message":
            messages.append(_chat_message(item["role"], item["content"]))
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            if isinstance(output, list):
                output = "\n".join(
                    p["text"]
                    for p in output
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        if thinking:
            last = messages[-1]
            if last["role"] == "assistant" and "thinking_blocks" not in last:
                last["thinking_blocks"] = thinking
            thinking = []  # a turn of another role came first: they belonged to no answer
    return messages


def carries_thinking(messages: list[dict[str, Any]]) -> bool:
    """Some assistant message carries signed thinking: only an Anthropic backend reads it."""
    return any("thinking_blocks" in m for m in messages if m["role"] == "assistant")


def _chat_message(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    if role == "assistant":
        texts = [p.get("text") or p.get("refusal") or "" for p in parts]
        return {"role": "assistant", "content": "\n".join(texts)}
    chat_parts: list[dict[str, Any]] = []
    for part in parts:
        kind = part["type"]
        if kind == "input_text":
            chat_parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            chat_parts.append({"type": "image_url", "image_url": image})
        else:  # input_file: a data: URL, as the chat API's file part takes it
            file: dict[str, Any] = {"file_data": part["file_data"]}
            if isinstance(part.get("filename"), str):
                file["filename"] = part["filename"]
            chat_parts.append({"type": "file", "file": file})
    if all(p["type"] == "text" for p in chat_parts):
        # Plain text stays a string: every chat template (and the cache key) reads it as such;
        # parts joined by a line break, as vLLM joins a list's text parts and Messages does.
        return {"role": role, "content": "\n".join(p["text"] for p in chat_parts)}
    return {"role": role, "content": chat_parts}
