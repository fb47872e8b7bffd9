"""How many tokens to reserve before a request runs: a cheap count, reconciled afterwards.

Prompt: the characters of the text the model reads (message contents and text parts, a
completion prompt, embedding inputs; the Responses API's ``instructions`` and ``input`` items,
Anthropic's ``system``) divided by ``CHARS_PER_TOKEN``, plus a few tokens per message for the
chat template; token-id prompts count their ids; an image part counts ``IMAGE_TOKENS``. No
tokenizer runs and the body is not parsed again (it walks the parsed dict). Output:
``max_completion_tokens``, ``max_tokens`` or ``max_output_tokens`` when the client gives one,
else the surface's expectation, times ``n`` (or ``best_of``) and the number of prompts of a
batched completions request. The real usage replaces the estimate when the response
ends, so a rough estimate costs accuracy only for the length of one request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4  # role and template tokens around each chat message
IMAGE_TOKENS = 765  # OpenAI's cost of one high-detail 512x512 tile set; a rough stand-in


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """A cheap count of a request's input tokens (chat, completions, embeddings, the Responses
    and Messages APIs)."""
    chars, extra = 0, 0
    for name in ("system", "instructions"):  # Anthropic's, the Responses API's
        c, e = _content(body.get(name))
        chars, extra = chars + c, extra + e
    items = body.get("messages")
    if not isinstance(items, list) and isinstance(body.get("input"), list):
        items = body["input"] if any(isinstance(i, dict) for i in body["input"]) else None
    if isinstance(items, list):
        for item in items:
            extra += PER_MESSAGE
            c, e = _content(item.get("content") if isinstance(item, dict) else item)
            chars, extra = chars + c, extra + e
        return _tokens(chars) + extra
    for name in ("prompt", "input"):
        value = body.get(name)
        if value is not None:
            return _tokens(chars) + extra + _prompt(value)
    return _tokens(chars) + extra


def output_tokens(body: Mapping[str, Any], expected: int) -> int:
    """The most the answer may use: the client's cap, else the surface's expectation; times the
    sequences generated (``n``, or a completion's ``best_of`` when larger) for each prompt (a
    completions request may batch several: each gets its own choices)."""
    cap = body.get("max_completion_tokens")
    for name in ("max_tokens", "max_output_tokens"):
        if not _count(cap):
            cap = body.get(name)
    n, best_of = body.get("n"), body.get("best_of")
    choices = n if _count(n) and n > 0 else 1
    if _count(best_of) and best_of > choices:
        choices = best_of
    return (cap if _count(cap) else expected) * choices * _prompts(body.get("prompt"))


def reserve_tokens(body: Mapping[str, Any], expected_output: int, generates: bool) -> int:
    """What a request reserves against tokens_per_minute (embeddings generate nothing)."""
    return prompt_tokens(body) + (output_tokens(body, expected_output) if generates else 0)


def _content(content: Any) -> tuple[int, int]:
    if isinstance(content, str):
        return len(content), 0
    chars, extra = 0, 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                chars += len(text)
            elif part.get("type") in (
                "image_url",
                "input_image",
                "image",
                "document",
                "input_file",
            ):
                extra += IMAGE_TOKENS
    return chars, extra


def _prompts(prompt: Any) -> int:
    """How many prompts a completions request holds: a list of texts or of token-id lists is a
    batch; a text or one list of token ids is one prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _prompt(value: Any) -> int:
    if isinstance(value, str):
        return _tokens(len(value))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # one prompt of token ids
        return sum(_prompt(v) for v in value)
    return 0


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
