"""Small builders shared by the routing tests."""

from __future__ import annotations

from routing.replica import Replica
from routing.router import RoutingRequest


def pool(n: int) -> list[Replica]:
    return [Replica("b", f"http://10.0.0.{i + 1}:8000/v1") for i in range(n)]


def req(text: str, *, tenant: str = "t", session: str | None = None) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_text=text, tenant=tenant, session_key=session)


def system_prompt(tag: str, chars: int = 2000) -> str:
    """A long, tag-specific system prompt (no two tags share a 16-character prefix)."""
    words = [f"{tag}-{i:05d}" for i in range(chars // 10 + 1)]
    return " ".join(words)[:chars]
