"""Parse and check OpenAI request bodies once; everything else passes through untouched.

Only what the gateway itself relies on is checked (the model, the messages or prompt, the
stream flag and a few numeric fields); every other field is forwarded as the client sent it.

``user_text`` is the one rule for "the user's text", the question a request asks now, shared
by the semantic cache (which matches it) and the difficulty estimator (which scores it): the
last message, when it is the user's and holds text only (a string, or text parts joined by
newlines) and nothing but ``role``, ``content`` and ``name``; for completions, the prompt when
it is one string. Anything else (an image part, a tool result last, token ids, blank text) has
no user's text: such a request is never matched semantically and scores no difficulty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

from cache.keys import content_text
from gateway.errors import BadRequest
from gateway.protocol import strict_json


class Endpoint(Enum):
    CHAT = "chat/completions"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    # Relayed untranslated to a backend that serves them itself (``responses: passthrough``,
    # Anthropic's Messages API to a ``kind: anthropic`` backend).
    RESPONSES = "responses"
    MESSAGES = "messages"

    @property
    def generates(self) -> bool:
        """Chat and completions: the gateway reads what they generate (cache, tiers and output
        caps apply); not embeddings, nor the untranslated passthroughs."""
        return self is Endpoint.CHAT or self is Endpoint.COMPLETIONS


@dataclass(slots=True)
class ParsedRequest:
    endpoint: Endpoint
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    user_text: str | None = None
    # The last message is the start of the assistant's answer (Anthropic's prefill): the model
    # continues it. A vLLM backend is told so (``CONTINUE_FINAL_MESSAGE``).
    continues: bool = False
    # Assistant messages carry signed thinking (``thinking_blocks``, from a Responses request's
    # reasoning items): an Anthropic backend reads them, others are sent the messages without.
    thinking: bool = False

    def body_for(self, upstream_model: str) -> bytes:
        """The bytes to send upstream: the client's own bytes unless the model is renamed."""
        if upstream_model == self.model:
            return self.raw
        return json.dumps({**self.body, "model": upstream_model}).encode()


# What tells vLLM's chat template to continue the last (assistant) message: without it vLLM
# opens a new assistant turn after it. Sent with a continued request and with its token count.
CONTINUE_FINAL_MESSAGE: Mapping[str, bool] = MappingProxyType(
    {"continue_final_message": True, "add_generation_prompt": False}
)

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of", "top_logprobs", "seed")
# Sequences generated per prompt, bounded as OpenAI's API bounds them: one request must not ask
# a replica for thousands of answers (it reserves tokens for each, and holds the KV cache).
_RANGES = {"n": (1, 128), "best_of": (1, 20)}
_NUM_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    body = strict_json.loads(raw)  # a 400 for anything but strict UTF-8 JSON
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
    elif endpoint is Endpoint.COMPLETIONS:
        _check_prompt(body.get("prompt"))
    else:
        _check_input(body.get("input"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if stream and not endpoint.generates:
        raise BadRequest("embeddings are not streamed: drop 'stream'", param="stream")
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadRequest(f"'{name}' must be an integer", param=name)
    for name, (low, high) in _RANGES.items():
        value = body.get(name)
        if value is not None and not low <= value <= high:
            raise BadRequest(f"'{name}' must be between {low} and {high}", param=name)
    for name in _NUM_FIELDS:
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise BadRequest(f"'{name}' must be a number", param=name)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return ParsedRequest(endpoint, raw, body, model, stream, user_text(endpoint, body))


_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name"})


def user_text(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """The user's text (see the module's docstring), or None."""
    text: str | None = None
    if endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else None
    elif endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if (
            isinstance(last, dict)
            and last.get("role") == "user"
            and last.keys() <= _PLAIN_MESSAGE_KEYS
        ):
            text = content_text(last.get("content"))
    return text if text is not None and text.strip() else None


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRequest(
                f"'messages[{i}].role' is required and must be a string",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"'messages[{i}].content' must be a string or an array of parts",
                param=f"messages[{i}].content",
            )


def _check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, (str, int))
            or (isinstance(p, list) and all(isinstance(t, int) for t in p))
            for p in prompt
        )
    ):
        return
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def _check_input(value: Any) -> None:
    """Embeddings ``input``: a string, strings, token ids, or arrays of token ids (non-empty)."""
    if value is None:
        raise BadRequest("'input' is required", param="input")
    if isinstance(value, str):
        return
    if (
        isinstance(value, list)
        and value
        and (
            all(isinstance(v, str) for v in value)
            or all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value)
        )
    ):
        return
    raise BadRequest(
        "'input' must be a string, an array of strings, an array of token ids, "
        "or an array of token id arrays",
        param="input",
    )
