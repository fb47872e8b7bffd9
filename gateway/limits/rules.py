"""What applies to a request (its tenant's limits and budget, the surface's limits) and the
store keys they live under.

Keys (``P`` = prefix; ``{t}`` = the tenant as a Redis Cluster hash tag, so one script touches
one slot): ``P:{t}:r`` / ``:k`` / ``:c`` the tenant's requests, tokens and concurrency;
``P:{t}:s:<surface>:r|k|c`` the same for the tenant on a surface; ``P:{t}:u:<window id>``
the tenant's usage record for a window (``gateway.limits.windows``).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

from gateway.limits.cost import usd_to_pico
from gateway.limits.windows import Window, WindowKind

OnExhausted = Literal["reject", "downgrade"]
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class RateLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __bool__(self) -> bool:
        return any(
            v is not None
            for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )


@dataclass(frozen=True, slots=True)
class BudgetRule:
    usd: Decimal
    window: WindowKind = "month"
    alert_at: tuple[Decimal, ...] = ()  # fractions of usd, each in (0, 1]
    on_exhausted: OnExhausted = "reject"
    cap: int = field(init=False)  # pUSD

    def __post_init__(self) -> None:
        object.__setattr__(self, "cap", usd_to_pico(self.usd))


@dataclass(frozen=True, slots=True)
class Subject:
    """Who asks and what binds them: built once per policy, looked up per request."""

    tenant: str
    surface: str
    limits: RateLimits | None = None  # the tenant's own
    surface_limits: RateLimits | None = None  # this tenant on this surface
    budget: BudgetRule | None = None

    @property
    def limited(self) -> bool:
        return bool(self.limits) or bool(self.surface_limits)


@functools.lru_cache(maxsize=4096)  # names come from the policy: few, asked on every request
def _tag(name: str) -> str:
    """A name safe inside a key and a hash tag: itself if plain, else a digest."""
    if _PLAIN.match(name):
        return name
    return "h" + hashlib.sha256(name.encode()).hexdigest()[:20]


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "lgw:lim"

    def scope(self, tenant: str, surface: str | None = None) -> str:
        base = f"{self.prefix}:{{{_tag(tenant)}}}"
        return base if surface is None else f"{base}:s:{_tag(surface)}"

    def record(self, tenant: str, window: Window) -> str:
        return f"{self.prefix}:{{{_tag(tenant)}}}:u:{window.id}"


def surface_field(surface: str, what: str) -> str:
    """A per-surface field of a usage record (``chat:n``, ``chat:cost$``)."""
    return f"{_tag(surface)}:{what}"
