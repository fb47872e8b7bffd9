"""Finished answers and streams of chunks: the one place that turns one into the other.

``render_sse`` streams a complete OpenAI answer (``chat.completion`` or ``text_completion``) as
the chunks an upstream would have sent: per choice, a role chunk, one chunk carrying the whole
content (text, ``reasoning_content``, ``refusal``, signed ``thinking_blocks``, tool calls with
their ``index`` and their ``arguments`` as JSON text, ``logprobs``), and a finish chunk (with
vLLM's ``stop_reason``, the stop string or token that ended the choice, when the answer has
one); then the usage chunk when the client asked for ``stream_options.include_usage``, and
``data: [DONE]``. It serves held cascade answers and cache hits alike.

``assemble`` does the reverse: it adds streamed chunk objects up to the complete answer they
make (content, reasoning, refusal, signed thinking blocks, tool calls merged by ``index``,
logprobs concatenated, vLLM's ``stop_reason``, the last usage seen), or None when the stream
did not finish or carried an error.

Two readings every re-telling of a chat answer shares (this module's assembler, the Responses
and Messages translators): ``arguments_text``, a tool call's ``arguments`` as JSON text (HF TGI
sends an object), and ``ToolCallSlots``, which call a streamed tool-call delta belongs to when
the upstream numbers none (Gemini's OpenAI endpoint sends whole calls without ``index``).
``finished`` says whether an answer is complete, successful and well formed: every choice
ended for a normal reason, and holds its text (and tool calls) in the types clients read. Both
give up (None, False) on an answer of any other shape: what they judge is what the cache may
store and serve again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.protocol.sse import DONE_EVENT, encode
from gateway.protocol.thinking import signed_blocks

_FINISHED = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
_NORMAL_FINISH = frozenset({"stop", "length", "tool_calls", "function_call"})
_HEAD = ("id", "created", "model", "system_fingerprint", "service_tier")
_TEXT_FIELDS = ("content", "reasoning_content", "refusal")
_MAX_INDEX = 1024  # choices (n) and tool calls of one answer: more is no answer


def render_json(answer: Mapping[str, Any]) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode()


def render_sse(answer: Mapping[str, Any], *, include_usage: bool = False) -> list[bytes]:
    """The SSE events of a complete answer, ending with ``data: [DONE]``."""
    chat = answer.get("object") == "chat.completion"
    head: dict[str, Any] = {k: answer[k] for k in _HEAD if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    if include_usage:
        head["usage"] = None  # as OpenAI sends it on every chunk but the last
    out: list[bytes] = []
    for choice in answer.get("choices") or []:
        if not isinstance(choice, Mapping):
            continue
        index = choice.get("index", 0)
        finish = choice.get("finish_reason") or "stop"
        parts = _chat_parts(choice) if chat else _text_parts(choice)
        for fields in parts:
            chunk = {"index": index, "logprobs": None, **fields, "finish_reason": None}
            out.append(encode({**head, "choices": [chunk]}))
        last: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
        end = {"index": index, **last, "finish_reason": finish}
        if "stop_reason" in choice:  # vLLM's: a Messages answer's stop_sequence is read from it
            end["stop_reason"] = choice["stop_reason"]
        out.append(encode({**head, "choices": [end]}))
    if include_usage:
        usage = answer.get("usage")
        out.append(encode({**head, "choices": [], "usage": usage}))
    out.append(DONE_EVENT)
    return out


def _chat_parts(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    message = choice.get("message") or {}
    first = {"delta": {"role": message.get("role") or "assistant", "content": ""}}
    delta: dict[str, Any] = {k: message[k] for k in _TEXT_FIELDS if message.get(k)}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [_streamed_call(call, i) for i, call in enumerate(calls)]
    if isinstance(message.get("function_call"), Mapping):
        delta["function_call"] = message["function_call"]
    if blocks := signed_blocks(message.get("thinking_blocks")):
        delta["thinking_blocks"] = blocks  # as an Anthropic backend's stream carries them
    body: dict[str, Any] = {"delta": delta}
    if choice.get("logprobs") is not None:
        body["logprobs"] = choice["logprobs"]
    return [first, body] if delta or "logprobs" in body else [first]


def _streamed_call(call: Any, position: int) -> Any:
    """A whole answer's tool call as a stream sends it: with its ``index``, its ``arguments``
    JSON text (an object, as HF TGI sends one, is written as such)."""
    if not isinstance(call, Mapping):
        return call
    out = {**call, "index": call.get("index", position)}
    function = call.get("function")
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), dict):
        text = arguments_text(function["arguments"])
        if text is not None:
            out["function"] = {**function, "arguments": text}
    return out


def _text_parts(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"text": choice.get("text") or ""}
    if choice.get("logprobs") is not None:
        body["logprobs"] = choice["logprobs"]
    return [body]


def finished(answer: Mapping[str, Any], cut_ok: bool = True) -> bool:
    """A complete, successful, well-formed answer (module comment); one cut at a token limit
    (``finish_reason: length``) only when ``cut_ok`` (the limit was the client's own)."""
    choices = answer.get("choices")
    if "error" in answer or not isinstance(choices, list) or not choices:
        return False
    chat = answer.get("object", "chat.completion") == "chat.completion"
    return all(_well_formed(c, chat, cut_ok) for c in choices)


def _well_formed(choice: Any, chat: bool, cut_ok: bool) -> bool:
    if not isinstance(choice, Mapping) or not _is_str(choice.get("finish_reason")):
        return False
    if choice["finish_reason"] not in _NORMAL_FINISH:
        return False
    if choice["finish_reason"] == "length" and not cut_ok:
        return False
    if not chat:
        return _is_str(choice.get("text"))
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return False
    if any(message.get(k) is not None and not _is_str(message[k]) for k in _TEXT_FIELDS):
        return False
    calls = message.get("tool_calls")
    return calls is None or (isinstance(calls, list) and all(_tool_call(c) for c in calls))


def _tool_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, Mapping) else None
    return (
        isinstance(function, Mapping)
        and _is_str(function.get("name"))
        and _is_str(function.get("arguments"))
    )


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _index(value: Any) -> int | None:
    """A choice's or tool call's ``index``: a small non-negative integer, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INDEX:
        return value
    return None


def arguments_text(value: Any) -> str | None:
    """A tool call's ``arguments`` as the JSON text clients parse: a string as it came, none as
    "", a JSON object (HF TGI sends one) as its compact JSON; None for any other shape (or an
    object nested past what the JSON encoder writes back)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return None


class ToolCallSlots:
    """Which tool call a streamed delta adds to. OpenAI numbers every delta with ``index``
    (used as it is). Without one (Gemini's OpenAI endpoint sends each call whole, several in
    one chunk, no ``index``): a delta with a new ``id`` is a new call, one with a known ``id``
    that call; one with neither continues the call the previous delta added to when it is its
    chunk's only call, else the call at its position in the chunk."""

    __slots__ = ("_ids", "_last", "_next")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._last: int | None = None
        self._next = 0  # past every slot given so far

    def slot(self, call: Mapping[str, Any], position: int, alone: bool) -> int:
        index = _index(call.get("index"))
        call_id = call.get("id")
        known = call_id if isinstance(call_id, str) and call_id else None
        if index is None and known is not None:
            index = self._ids.get(known, self._next)
        if index is None:
            index = self._last if alone and self._last is not None else position
        if known is not None:
            self._ids.setdefault(known, index)
        self._last = index
        self._next = max(self._next, index + 1)
        return index


class _Choice:
    __slots__ = (
        "blocks",
        "finish",
        "logprobs",
        "role",
        "slots",
        "stop_reason",
        "text",
        "told_stop",
        "tools",
    )

    def __init__(self) -> None:
        self.role = "assistant"
        self.text: dict[str, list[str]] = {}
        self.blocks: list[dict[str, Any]] = []  # signed thinking (``gateway.protocol.thinking``)
        self.tools: dict[int, dict[str, Any]] = {}
        self.slots = ToolCallSlots()
        self.logprobs: dict[str, Any] | None = None
        self.finish: str | None = None
        self.told_stop = False  # the stream carried vLLM's ``stop_reason`` (null until the end)
        self.stop_reason: str | int | None = None


def assemble(chunks: Iterable[Mapping[str, Any]], *, done: bool) -> dict[str, Any] | None:
    """The complete answer a stream of chunk objects adds up to; None if unfinished or failed.

    ``done`` says whether ``data: [DONE]`` arrived: a stream cut short never adds up.
    """
    if not done:
        return None
    head: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    chat = True
    usage: Any = None
    for chunk in chunks:
        if "error" in chunk:
            return None
        for key in _HEAD:
            if chunk.get(key) is not None and key not in head:
                head[key] = chunk[key]
        chat = chunk.get("object", "chat.completion.chunk") == "chat.completion.chunk"
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        parts = chunk.get("choices")
        if parts is not None and not isinstance(parts, list):
            return None
        for part in parts or ():
            index = _index(part.get("index", 0)) if isinstance(part, Mapping) else None
            if index is None:
                return None
            slot = choices.setdefault(index, _Choice())
            if part.get("finish_reason"):
                slot.finish = part["finish_reason"]
            if "stop_reason" in part:
                _merge_stop_reason(slot, part["stop_reason"])
            _merge_logprobs(slot, part.get("logprobs"))
            if not chat:
                text = part.get("text") or ""
                if not _is_str(text):
                    return None
                slot.text.setdefault("text", []).append(text)
                continue
            delta = part.get("delta") or {}
            if not isinstance(delta, Mapping):
                return None
            if _is_str(delta.get("role")) and delta["role"]:
                slot.role = delta["role"]
            for name in _TEXT_FIELDS:
                if delta.get(name):
                    if not _is_str(delta[name]):
                        return None
                    slot.text.setdefault(name, []).append(delta[name])
            slot.blocks.extend(signed_blocks(delta.get("thinking_blocks")))
            calls = delta.get("tool_calls") or []
            if not isinstance(calls, list) or not all(
                _merge_tool_call(slot.tools, slot.slots, c, k, len(calls) == 1)
                for k, c in enumerate(calls)
            ):
                return None
    if not choices or any(
        not _is_str(s.finish) or s.finish not in _FINISHED for s in choices.values()
    ):
        return None
    out = [_choice(i, choices[i], chat) for i in sorted(choices)]
    answer = {**head, "object": "chat.completion" if chat else "text_completion", "choices": out}
    if usage is not None:
        answer["usage"] = usage
    return answer


def _choice(index: int, slot: _Choice, chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index}
    if chat:
        message: dict[str, Any] = {
            "role": slot.role,
            "content": "".join(slot.text.get("content", [])),
        }
        for name in ("reasoning_content", "refusal"):
            if name in slot.text:
                message[name] = "".join(slot.text[name])
        if slot.blocks:
            message["thinking_blocks"] = slot.blocks
        if slot.tools:
            message["tool_calls"] = [slot.tools[i] for i in sorted(slot.tools)]
            message["content"] = message["content"] or None
        out["message"] = message
    else:
        out["text"] = "".join(slot.text.get("text", []))
    out["logprobs"] = slot.logprobs
    out["finish_reason"] = slot.finish
    if slot.told_stop:
        out["stop_reason"] = slot.stop_reason
    return out


def _merge_stop_reason(slot: _Choice, value: Any) -> None:
    """vLLM's ``stop_reason``: the stop string (or token id) that ended the choice, null on
    every chunk before; a value of another shape is not kept."""
    slot.told_stop = True
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        slot.stop_reason = value


def _merge_logprobs(slot: _Choice, logprobs: Any) -> None:
    """Chat logprobs are ``{content: [...], refusal: [...]}``; completions' are parallel lists."""
    if not isinstance(logprobs, Mapping):
        return
    if slot.logprobs is None:
        slot.logprobs = {}
    for key, value in logprobs.items():
        if isinstance(value, list):
            slot.logprobs.setdefault(key, []).extend(value)
        elif key not in slot.logprobs:
            slot.logprobs[key] = value


def _merge_tool_call(
    tools: dict[int, dict[str, Any]], slots: ToolCallSlots, call: Any, position: int, alone: bool
) -> bool:
    """Add a tool call delta to the calls so far; False when it has another shape."""
    if not isinstance(call, Mapping) or ("index" in call and _index(call["index"]) is None):
        return False
    function = call.get("function") or {}
    if not isinstance(function, Mapping):
        return False
    index = slots.slot(call, position, alone)
    name, arguments = function.get("name") or "", arguments_text(function.get("arguments"))
    if not _is_str(name) or arguments is None:
        return False
    slot = tools.setdefault(
        index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if call.get("id"):
        slot["id"] = call["id"]
    if call.get("type"):
        slot["type"] = call["type"]
    slot["function"]["name"] += name
    slot["function"]["arguments"] += arguments
    return True
