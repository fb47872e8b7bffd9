"""Chat options that Anthropic's Messages API spells differently, for the Anthropic backend.

- **Structured output** (``response_format: json_schema``): Anthropic's tools take a JSON schema
  for their input, so the schema becomes one more tool (named after the schema) that the model
  is made to call (``tool_choice: {type: tool}``; ``any`` when the client has tools of its own,
  so the model may still call those; ``auto`` with an instruction when thinking is on, as the API
  refuses a forced tool with thinking). The call's ``input`` is the answer: it comes back as the
  message ``content`` (streamed as it is generated: its ``input_json_delta`` fragments become
  content deltas) with ``finish_reason: stop``. ``json_object`` is the same with an open schema.
- **Reasoning effort** (``reasoning_effort``) -> ``thinking: {type: enabled, budget_tokens}``:
  minimal 1,024, low 2,048, medium 8,192, high 24,576, xhigh and max 32,000 tokens; ``none`` no
  thinking. Anthropic counts thinking inside ``max_tokens``. Without a limit the budget is added
  to the backend's ``default_max_tokens``; a limit (the client's ``max_completion_tokens`` or
  ``max_tokens``, which OpenAI counts reasoning in, or the gateway's output cap) bounds thinking
  and answer together: the budget shrinks to leave ``MIN_ANSWER_TOKENS`` for the answer, down to
  Anthropic's least budget (1,024); a limit too small for that sends no thinking. Thinking
  refuses a temperature or ``top_k``: asking for both is a 400.
- **PDF documents**: a chat ``file`` part holding a base64 PDF ``data:`` URL becomes a
  ``document`` block.
- **Prompt-cache markers**: a ``cache_control`` on a chat content part is kept on its block.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.errors import BadRequest

THINKING_BUDGETS = {
    "minimal": 1024,
    "low": 2048,
    "medium": 8192,
    "high": 24576,
    "xhigh": 32000,
    "max": 32000,
}
MIN_THINKING_BUDGET = 1024  # Anthropic refuses a smaller budget_tokens
MIN_ANSWER_TOKENS = 256  # left for the answer when a limit bounds thinking and answer together
_PDF = "data:application/pdf;base64,"
_NAME = re.compile(r"[^a-zA-Z0-9_-]")


def format_tool_name(body: dict[str, Any]) -> str | None:
    """The name of the tool that carries the structured answer, or None without one."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    spec = _spec(fmt)
    raw = spec.get("name")
    name = _NAME.sub("_", raw if isinstance(raw, str) else "")[:64] or "json_output"
    taken = {
        (t.get("function") or {}).get("name")
        for t in body.get("tools") or ()
        if isinstance(t, dict)
    }
    return name if name not in taken else f"{name}_output"


def _spec(fmt: dict[str, Any]) -> dict[str, Any]:
    spec = fmt.get("json_schema")
    return spec if isinstance(spec, dict) else {}


def structured_output(body: dict[str, Any], out: dict[str, Any]) -> None:
    """Add the format tool and the tool choice that makes the model answer through it."""
    name = format_tool_name(body)
    if name is None:
        return
    fmt = body["response_format"]
    spec = _spec(fmt)
    schema = spec.get("schema") if isinstance(spec.get("schema"), dict) else None
    if fmt["type"] == "json_schema" and schema is None:
        raise BadRequest(
            "'response_format.json_schema.schema' must be an object",
            param="response_format.json_schema.schema",
        )
    description = spec.get("description") if isinstance(spec.get("description"), str) else None
    tool = {
        "name": name,
        "description": description or "Give the final answer as this tool's input.",
        "input_schema": schema or {"type": "object"},
    }
    out["tools"] = [*out.get("tools", []), tool]
    if "thinking" in out:
        out["tool_choice"] = {"type": "auto"}
        note = {"type": "text", "text": f"Give your final answer by calling the tool {name}."}
        out["system"] = [*out.get("system", []), note]
    elif len(out["tools"]) > 1 and body.get("tool_choice") != "none":
        out["tool_choice"] = {"type": "any"}
    else:
        out["tool_choice"] = {"type": "tool", "name": name}


def thinking(body: dict[str, Any], out: dict[str, Any], limit: int | None) -> None:
    """``reasoning_effort`` as Anthropic's thinking budget, added to ``out["max_tokens"]`` (the
    answer's room) within ``limit`` (the client's limit or the gateway's cap, if any)."""
    effort = body.get("reasoning_effort")
    if effort is None or effort == "none":
        return
    budget = THINKING_BUDGETS.get(effort) if isinstance(effort, str) else None
    if budget is None:
        raise BadRequest(
            "'reasoning_effort' must be none, minimal, low, medium, high, xhigh or max",
            param="reasoning_effort",
        )
    for name in ("temperature", "top_k"):
        if out.get(name) is not None:
            raise BadRequest(
                f"'{name}' cannot be combined with 'reasoning_effort' on Anthropic backends "
                "(extended thinking refuses it)",
                param=name,
            )
    total = out["max_tokens"] + budget
    if limit is not None and total > limit:
        total = limit
        budget = min(budget, total - MIN_ANSWER_TOKENS)
        if budget < MIN_THINKING_BUDGET:
            return  # no room for the least budget and an answer: the answer without thinking
    out["max_tokens"] = total
    out["thinking"] = {"type": "enabled", "budget_tokens": budget}


def document(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A chat ``file`` part (a base64 PDF) as a ``document`` block."""
    file = part.get("file")
    data = file.get("file_data") if isinstance(file, dict) else None
    if not isinstance(data, str) or not data.startswith(_PDF) or len(data) == len(_PDF):
        raise BadRequest(
            "a file part must be a base64 PDF (file_data: data:application/pdf;base64,...) "
            "for Anthropic backends",
            param=f"{where}.file",
        )
    block: dict[str, Any] = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": data[len(_PDF) :]},
    }
    assert isinstance(file, dict)
    if isinstance(file.get("filename"), str) and file["filename"]:
        block["title"] = file["filename"]
    return with_cache_marker(part, block)


def with_cache_marker(part: Any, block: dict[str, Any]) -> dict[str, Any]:
    """``block`` with the part's ``cache_control`` (Anthropic's prompt-cache breakpoint)."""
    if isinstance(part, dict) and isinstance(part.get("cache_control"), dict):
        block["cache_control"] = part["cache_control"]
    return block


def structured_content(blocks: list[Any], name: str | None) -> tuple[str | None, list[Any]]:
    """(the answer in the format tool's input as JSON text, the other blocks)."""
    if name is None:
        return None, blocks
    for k, block in enumerate(blocks):
        if (
            isinstance(block, dict)
            and block.get("type") == "tool_use"
            and block.get("name") == name
        ):
            text = json.dumps(block.get("input") or {})
            return text, blocks[:k] + blocks[k + 1 :]
    return None, blocks
