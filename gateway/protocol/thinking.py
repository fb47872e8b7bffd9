"""Signed thinking blocks, kept across turns that the chat API cannot carry them through.

An Anthropic backend's answer carries its thinking as ``thinking_blocks`` (type ``thinking``
with its ``signature``, or ``redacted_thinking`` with its ``data``): Anthropic refuses to
continue a tool loop with thinking unless the assistant turn starts with the block it signed.
A Responses client keeps them in the ``reasoning`` item's ``encrypted_content`` (sealed here:
opaque to it, as OpenAI's own is) and sends that item back, or the gateway keeps them in the
stored conversation; ``gateway.protocol.responses.input_messages`` rebuilds them on the
assistant message that follows. Only blocks of the two shapes above are kept: anything else
(a foreign ``encrypted_content``, a block without a signature) is left out, never sent.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

_SEALED = "llmgw-thinking-1:"


def signed_blocks(given: Any) -> list[dict[str, Any]]:
    """The blocks of ``given`` that can be sent back, each with only its own fields."""
    blocks: list[dict[str, Any]] = []
    for block in given if isinstance(given, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        thought, signature, data = block.get("thinking"), block.get("signature"), block.get("data")
        if kind == "thinking" and isinstance(thought, str) and isinstance(signature, str):
            if signature:
                blocks.append({"type": "thinking", "thinking": thought, "signature": signature})
        elif kind == "redacted_thinking" and isinstance(data, str):
            blocks.append({"type": "redacted_thinking", "data": data})
    return blocks


def seal(blocks: list[dict[str, Any]]) -> str:
    """``encrypted_content`` for a reasoning item holding ``blocks``."""
    text = json.dumps(blocks, separators=(",", ":"), ensure_ascii=False)
    return _SEALED + base64.urlsafe_b64encode(text.encode()).decode()


def unseal(value: Any) -> list[dict[str, Any]]:
    """The blocks a reasoning item's ``encrypted_content`` holds; none when it is not ours."""
    if not isinstance(value, str) or not value.startswith(_SEALED):
        return []
    try:
        text = base64.urlsafe_b64decode(value[len(_SEALED) :].encode())
        return signed_blocks(json.loads(text))
    except (binascii.Error, ValueError, RecursionError):
        return []
