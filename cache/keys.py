"""Keys of the response cache: scope, exact key, context key.

* **Scope** ``(tenant, model alias, namespace)``: every key below is derived from it, every
  index group is keyed by it and every stored entry carries it and is compared with the
  request's scope before it is served, so an entry of one tenant cannot answer another.
* **Exact key**: SHA-256 of the canonical JSON of the whole request minus fields that do not
  change the answer (``stream``, ``stream_options``, ``user``, ``metadata``, ...). Unknown
  fields stay in the key: a field we do not know about can only cost hits, never serve a
  wrong answer. Numbers are compared as values: ``temperature: 0``, ``0.0`` and ``-0.0`` are
  one key. A request whose last (assistant) message is continued (Anthropic's prefill, sent to
  vLLM with ``continue_final_message``) is another prompt than the same messages asking for a
  new assistant turn (a chat request): ``continues`` keeps their keys apart.
* **Context key**: the same canonical request with the query text (the user's text: the last
  message's content, or the prompt, as the gateway's one rule found it) taken out. Semantic
  matching compares that text's embedding only among entries whose context key is equal (same
  system prompt, same earlier turns, same model and sampling parameters).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Fields that shape the transport or bookkeeping, not the answer.
IGNORED_FIELDS = frozenset(
    {"stream", "stream_options", "user", "metadata", "store", "service_tier", "safety_identifier"}
)

Endpoint = Literal["chat/completions", "completions"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def canonical_json(value: Any) -> str:
    return json.dumps(
        _numbers_as_values(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def _numbers_as_values(value: Any) -> Any:
    """A whole float as an int (``1.0`` -> ``1``, ``-0.0`` -> ``0``), in lists and objects too:
    JSON spells one number many ways, and the answer depends on the value."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {k: _numbers_as_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numbers_as_values(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class CacheScope:
    tenant: str
    model: str
    namespace: str

    def tenant_prefix(self) -> str:
        return scope_prefix(self.tenant)

    def path(self) -> str:
        """``<tenant>:<namespace>:<model>`` as digests: safe in Redis keys and glob patterns."""
        return f"{_digest(self.tenant)}:{_digest(self.namespace)}:{_digest(self.model)}"

    def as_dict(self) -> dict[str, str]:
        return {"tenant": self.tenant, "model": self.model, "namespace": self.namespace}


def scope_prefix(tenant: str, namespace: str | None = None) -> str:
    """Leading part of ``CacheScope.path`` shared by a tenant (and namespace): for purges."""
    if namespace is None:
        return f"{_digest(tenant)}:"
    return f"{_digest(tenant)}:{_digest(namespace)}:"


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What the caches need to know about one request, computed once per request."""

    scope: CacheScope
    exact_key: str
    context_key: str
    query_text: str | None  # the user's text, matched semantically; None: exact only
    temperature: float | None


def content_text(content: Any) -> str | None:
    """Text of a message's content (text parts joined by newlines); None when it holds anything
    but text (the gateway's rule for the user's text uses it too)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "\n".join(texts)
    return None


def _canonical_message(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    out = dict(message)
    text = content_text(out.get("content"))
    if text is not None and isinstance(out.get("content"), list):
        # A list of text parts and the same text as a plain string ask the same question.
        out["content"] = text
    return out


def _canonical_params(body: Mapping[str, Any], drop: str) -> dict[str, Any]:
    params = {k: v for k, v in body.items() if k not in IGNORED_FIELDS and k != drop}
    stop = params.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    return params


def build_request(
    body: Mapping[str, Any],
    scope: CacheScope,
    endpoint: Endpoint = "chat/completions",
    query_text: str | None = None,
    continues: bool = False,
) -> CacheRequest:
    """Keys for a parsed request body (``messages`` for chat, ``prompt`` for completions).

    ``query_text`` is the user's text, taken from the last message (chat) or the prompt
    (completions) by the caller; None makes the request exact-only. ``continues``: the answer
    continues the last message rather than opening a new turn.
    """
    temperature = body.get("temperature")
    temp = float(temperature) if isinstance(temperature, (int, float)) else None
    scope_part = canonical_json([scope.tenant, scope.model, scope.namespace, endpoint])
    if endpoint == "chat/completions":
        raw_messages = body.get("messages")
        messages = (
            [_canonical_message(m) for m in raw_messages] if isinstance(raw_messages, list) else []
        )
        params = _canonical_params(body, "messages")
        turn = {"continues": True} if continues else {}  # absent: the keys stored until now
        exact = canonical_json({"messages": messages, "params": params, **turn})
        context_messages: list[Any] = messages
        if query_text is not None and messages and isinstance(messages[-1], Mapping):
            context_messages = [*messages[:-1], {**messages[-1], "content": None}]
        context = canonical_json({"messages": context_messages, "params": params, **turn})
    else:
        params = _canonical_params(body, "prompt")
        prompt = body.get("prompt")
        exact = canonical_json({"prompt": prompt, "params": params})
        context = canonical_json(
            {"prompt": None if query_text is not None else prompt, "params": params}
        )
    return CacheRequest(
        scope=scope,
        exact_key=_digest(scope_part + "\x00" + exact),
        context_key=_digest(scope_part + "\x00" + context),
        query_text=query_text,
        temperature=temp,
    )
