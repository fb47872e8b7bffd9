"""Counting a Messages request's input tokens: vLLM's ``/tokenize``, or a documented estimate.

A vLLM backend counts with the model's own tokenizer and chat template: ``POST /tokenize`` (at
the server's root, beside ``/v1``) with the translated chat messages and tools and
``add_generation_prompt: true`` (a prefill: the options that continue the last message, as the
request itself is sent) answers ``{"count": N, ...}``, the prompt tokens a generation would be
charged. A backend without a tokenizer endpoint (an OpenAI-compatible API) gets an
estimate: one token per 4 characters of the messages' text and the tools' JSON, rounded up,
plus 3 per message for the chat template's markers (OpenAI's published rule of thumb).
"""

from __future__ import annotations

import json
import math
from typing import Any

from gateway.protocol.openai import CONTINUE_FINAL_MESSAGE

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 3


def tokenize_body(chat: dict[str, Any], upstream_model: str, continues: bool) -> dict[str, Any]:
    """``continues``: the last message is continued (a prefill), not followed by a new turn."""
    body: dict[str, Any] = {"model": upstream_model, "messages": chat["messages"]}
    body.update(CONTINUE_FINAL_MESSAGE if continues else {"add_generation_prompt": True})
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    return body


def tokenize_url(base_url: str) -> str:
    """vLLM serves ``/tokenize`` at its root; replicas are configured with their ``/v1``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/tokenize"


def read_count(data: Any) -> int | None:
    count = data.get("count") if isinstance(data, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def estimate(chat: dict[str, Any]) -> int:
    chars = 0
    for message in chat["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        for call in message.get("tool_calls") or ():
            chars += len(json.dumps(call.get("function") or {}))
    if chat.get("tools"):
        chars += len(json.dumps(chat["tools"]))
    messages = len(chat["messages"])
    return math.ceil(chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * messages
