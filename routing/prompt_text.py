"""Render a request body into the text a prefix-aware router hashes.

Routers match prompt prefixes, so the rendering must put what stays the same across requests
(system prompt, earlier turns) first and must be stable: the same messages always give the same
text. For chat requests we render ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message,
then the assistant header), the template of most open chat models and of the project's tiny test
model; for a model whose template differs, the text still has the right prefix structure, which is
all the approximate index needs. The precise index (KV events) tokenizes this text, so there an
exact match with the engine's template matters; see ``routing/kv_events.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    # Images and audio: a fixed marker keeps the prefix structure.
                    parts.append(f"<{part.get('type', 'part')}>")
            else:
                parts.append(str(part))
        return "".join(parts)
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    out: list[str] = []
    for message in messages:
        role = str(message.get("role", "user"))
        out.append(f"{IM_START}{role}\n{_content_text(message.get('content'))}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def render_for_routing(body: Mapping[str, Any]) -> str:
    """The routing text of an OpenAI chat or completions request body ("" if it has none)."""
    messages = body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        return render_chat([m for m in messages if isinstance(m, Mapping)])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            # A batch of prompts is served as separate requests; route on the first.
            return first
        if isinstance(first, int):
            return " ".join(str(t) for t in prompt)
        if isinstance(first, Sequence):
            return " ".join(str(t) for t in first)
    return ""
