"""Requests whose answer does not carry over to another request: exact-only or not cached.

A semantic hit serves one user's answer to another user's similar question. That is right
only when the answer depends on the question alone. Three documented rules catch requests
whose answer depends on something else; each is set per surface (``cache.rules`` in the
policy: ``semantic`` turns the rule off, ``exact`` allows exact matches only, ``off`` keeps the
request out of the cache):

* ``tools``: the request offers tools or functions, or the conversation carries tool calls
  or tool results: the answer depends on what the tools returned (default ``exact``);
* ``time``: the user's text asks about the present ("today", "tonight", "now", "right now",
  "currently", "current", "latest", "recent(ly)", "this week/month/year/weekend",
  "yesterday", "tomorrow", "up to date", "as of"): the answer ages (default ``exact``, whose
  ``exact_ttl`` is the operator's statement of how long an answer stays good);
* ``personal``: the user's text asks about their own records: "my" followed within two tokens
  (words, emoji, symbols: "my \U0001f4e6 order") by a record noun (account, order, balance, bill,
  payment, subscription, booking, reservation, delivery, package, refund, calendar, inbox,
  appointment, ...), unless the request asks how to do something ("how do I ...", "how to
  ..."), which is the same for everyone (default ``off``: even the exact cache is shared by
  every user of a tenant). "Our" is left out: in "our refund policy" it is the company's.

The most restrictive mode among the rules that fire applies. ``time`` and ``personal`` see
through invisible format characters (Unicode category Cf: zero-width spaces and joiners, soft
hyphens, direction marks): a rule fires when it fires on the text with each of them removed
("to\u00addays") or read as a space ("my\u200border").

One more restriction is not a setting: a request that asks for its prompt back (``echo:
true`` on completions, vLLM's chat ``echo``, ``prompt_logprobs``) is exact-only whatever the
rules say (``echoes_prompt``; the plan's rule is ``echo``): a semantic hit would echo another
user's prompt, or its log-probabilities.

``time`` and ``personal`` read the text of the last user message themselves when the caller
has no user's text (``query_text`` is None): the gateway's user's text exists only for a plain
text message, and a question asked with an image beside it, or through the Messages or
Responses API (translated to a chat body before the cache sees it), has none. Such a request
is exact-only for the semantic cache, but the rules must still keep "where is my order?" out
of the tenant-wide exact cache, whatever API or content parts it came with.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any, Literal

from policies.cache import CacheRules

Mode = Literal["semantic", "exact", "off"]
_ORDER: dict[str, int] = {"semantic": 0, "exact": 1, "off": 2}

_TIME = re.compile(
    r"\b(?:today|today's|tonight|tomorrow|yesterday|now|right now|currently|current|latest|"
    r"recent|recently|nowadays|this (?:morning|afternoon|evening|week|weekend|month|year)|"
    r"up[- ]to[- ]date|as of)\b",
    re.IGNORECASE,
)
_RECORDS = (
    "account|accounts|order|orders|balance|bill|bills|billing|invoice|invoices|payment|payments|"
    "subscription|subscriptions|plan|booking|bookings|reservation|reservations|ticket|tickets|"
    "delivery|deliveries|package|packages|parcel|shipment|refund|refunds|claim|claims|"
    "application|appointment|appointments|calendar|schedule|inbox|emails|messages|statement|"
    "statements|points|credit score|results|prescription|prescriptions|policy|status|profile|"
    "history|cart|loan|salary|paycheck|benefits|deadline"
)
_PERSONAL = re.compile(
    rf"\bmy\s+(?:\S+\s+)?(?:{_RECORDS})\b",
    re.IGNORECASE,
)
_HOW_TO = re.compile(r"\bhow\s+(?:do|can|could|should|would)\s+(?:i|we|you)\b|\bhow\s+to\b", re.I)


def echoes_prompt(body: Mapping[str, Any]) -> bool:
    """The answer repeats the prompt or scores its tokens: only the same prompt may share it."""
    return bool(body.get("echo")) or body.get("prompt_logprobs") is not None


def uses_tools(body: Mapping[str, Any]) -> bool:
    if body.get("tools") or body.get("functions"):
        return True
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") in ("tool", "function") or message.get("tool_calls"):
            return True
    return False


def asked_text(body: Mapping[str, Any]) -> str | None:
    """The text of the last user message (every text part, whatever else it holds), or the
    prompt of a completion; None when there is none. Wider than the user's text on purpose:
    a rule must see the question even where semantic matching does not apply."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, Mapping) and message.get("role") == "user":
                return _texts(message.get("content"))
        return None
    return _texts(body.get("prompt"))


def _texts(content: Any) -> str | None:
    """A string, or the strings and ``text`` fields of a list's items, joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "\n".join(texts) if texts else None


def readings(text: str) -> tuple[str, ...]:
    """The text as a reader sees it: invisible format characters (category Cf) removed, and
    read as spaces (a zero-width space between two words)."""
    if text.isascii() or not any(unicodedata.category(c) == "Cf" for c in text):
        return (text,)
    removed = "".join(c for c in text if unicodedata.category(c) != "Cf")
    spaced = "".join(" " if unicodedata.category(c) == "Cf" else c for c in text)
    return (removed, spaced)


def about_now(text: str | None) -> bool:
    return bool(text) and any(_TIME.search(t) for t in readings(text or ""))


def about_own_records(text: str | None) -> bool:
    if not text:
        return False
    return any(not _HOW_TO.search(t) and _PERSONAL.search(t) is not None for t in readings(text))


def fired(body: Mapping[str, Any], text: str | None) -> list[str]:
    """The names of the rules that apply to this request; ``text`` is the user's text, and
    the last user message's text (``asked_text``) stands in when it is None."""
    if text is None:
        text = asked_text(body)
    out = []
    if uses_tools(body):
        out.append("tools")
    if about_now(text):
        out.append("time")
    if about_own_records(text):
        out.append("personal")
    return out


def mode_for(rules: CacheRules, names: list[str]) -> tuple[Mode, str | None]:
    """The most restrictive mode among the fired rules, and the rule that set it."""
    mode: Mode = "semantic"
    reason: str | None = None
    for name in names:
        candidate: Mode = getattr(rules, name)
        if _ORDER[candidate] > _ORDER[mode]:
            mode, reason = candidate, name
    return mode, reason
