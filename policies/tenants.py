"""Tenants: who calls, known by API key, and what binds them (rate limits, a spend budget).

```yaml
tenants:                       # none: the gateway is open; any: a key is required
  team-a:
    api_keys: ["${TENANT_A_KEY}"]                 # plaintext keys only from the environment
    limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}
    budget: {usd: 50, window: month, alert_at: [0.5, 0.8, 0.95], on_exhausted: reject}
  team-b: {api_key_sha256: ["9f86d08188...4a08"]}   # or sha256 hex digests
```

Limits hold across every gateway instance sharing ``shared_state.redis_url`` (one instance's
memory otherwise). A budget counts the cost of answers (``models.<alias>.price``) per
calendar window in UTC; ``on_exhausted: downgrade`` serves the alias's small tier (or the
model ``downgrade_to`` names) instead of refusing.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.strict import Strict

MAX_RATE = 1_000_000_000  # per minute: the limiter's integer arithmetic stays exact below 2**53


class RateLimits(Strict):
    """Per minute, and at once; each limit is off unless given."""

    requests_per_minute: int | None = Field(None, ge=1, le=MAX_RATE)
    tokens_per_minute: int | None = Field(None, ge=1, le=MAX_RATE)
    max_concurrent: int | None = Field(None, ge=1, le=1_000_000)


class SpendBudget(Strict):
    usd: Decimal = Field(gt=0, le=Decimal(10**12), decimal_places=12)
    window: Literal["day", "week", "month"] = "month"  # calendar-aligned, UTC
    alert_at: list[Decimal] = []  # fractions of usd; each fires once per window
    on_exhausted: Literal["reject", "downgrade"] = "reject"
    downgrade_to: str | None = None  # a model alias; default: the alias's small tier

    @field_validator("alert_at")
    @classmethod
    def _fractions(cls, value: list[Decimal]) -> list[Decimal]:
        for fraction in value:
            if not 0 < fraction <= 1:
                raise ValueError(f"alert_at fractions must be in (0, 1]: {fraction}")
        if len(set(value)) != len(value):
            raise ValueError("alert_at fractions must be distinct")
        return sorted(value)

    @model_validator(mode="after")
    def _downgrade(self) -> SpendBudget:
        if self.downgrade_to is not None and self.on_exhausted != "downgrade":
            raise ValueError("downgrade_to applies to on_exhausted: downgrade only")
        return self


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NOT_IN_KEYS = re.compile(r"[\s\x00-\x1f\x7f]")


class Tenant(Strict):
    api_keys: list[str] = []  # plaintext keys, only from ${ENV_VARS}
    api_key_sha256: list[str] = []  # hex digests of keys
    limits: RateLimits | None = None
    budget: SpendBudget | None = None

    @field_validator("api_keys")
    @classmethod
    def _nonempty(cls, value: list[str]) -> list[str]:
        for key in value:
            if len(key) < 8:
                raise ValueError("an API key must have at least 8 characters")
            if _NOT_IN_KEYS.search(key):  # a key read from a file often ends in a newline
                raise ValueError(
                    "an API key must not hold spaces or control characters (is the variable "
                    "padded, or does it end in a newline?)"
                )
        return value

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not _HEX64.match(digest):
                raise ValueError(  # never the value: it may be the key itself
                    f"not a lowercase hex sha256 digest (a value of {len(digest)} characters); "
                    "give the key's digest (sha256sum), or the key itself in api_keys"
                )
        return value
