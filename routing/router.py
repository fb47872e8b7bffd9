"""The Router interface: one small protocol, one module per strategy, one factory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from routing.replica import Replica


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a router may look at: the request's model and its prompt, rendered as text."""

    model: str
    prompt_text: str
    tenant: str = "anonymous"
    session_key: str | None = None


@dataclass(slots=True)
class RoutingDecision:
    replica: Replica
    reason: str  # "least_loaded", "prefix", "load", "cold", "round_robin", "session", ...
    matched_prefix: int = 0  # prefix length matched (characters or tokens, strategy-specific)


class Router(Protocol):
    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        """Pick one of ``replicas`` (already filtered to available ones), or None if empty."""
        ...


@runtime_checkable
class Peeks(Protocol):
    """A router that can tell where it would send a request without recording it (no turn
    moved, nothing indexed): a hedge asks it for its second replica. The prefix routers do:
    the hedge then goes where the prompt's prefix is cached, not merely to the least loaded."""

    def peek(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None: ...
