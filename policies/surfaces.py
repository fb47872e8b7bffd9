"""Surfaces: which requests a surface matches, its latency budget, priority and actions.

```yaml
surfaces:
  voice:
    match: {header: voice, tenants: [team-a]}   # X-Surface: voice, or team-a's traffic
    budget: {ttft_ms: 300, itl_ms: 40, total_ms: 5000, percentile: p99}
    priority: interactive         # interactive | standard | background
    actions: {admission: true, budget_routing: true, cap_output: false, deadline: true,
              hedge: {enabled: true, delay_ms: auto, max_fraction: 0.1}}
    cache: {exact: true}          # policies/cache.py
    limits: {requests_per_minute: 100}   # per tenant on this surface (policies/tenants.py)
```
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from policies.cache import CachePolicy
from policies.strict import MAX_MS, Strict
from policies.tenants import RateLimits

Priority = Literal["interactive", "standard", "background"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "standard", "background")


class HedgeConfig(Strict):
    """Send the request to a second replica when the first token is late.

    ``delay_ms: auto`` waits for the other replicas' recent TTFT p90 (their p50 when the
    primary is known to be slow; never past the surface's ``ttft_ms``); a number fixes it.
    ``max_fraction`` bounds hedges to that share of the surface's requests (a token bucket).
    """

    enabled: bool = False
    delay_ms: float | Literal["auto"] = "auto"
    max_fraction: float = Field(0.1, gt=0, le=1)
    min_delay_ms: float = Field(10.0, ge=0, le=MAX_MS)  # "auto" never hedges sooner than this

    @field_validator("delay_ms", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        """One error, not one per branch of the union; NaN fails the comparison."""
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_MS:
            raise ValueError(f"delay_ms must be 'auto' or a number > 0, at most {MAX_MS:,} (a day)")
        return value


class SurfaceActions(Strict):
    """Which enforcement actions run for a surface; each one is switchable on its own."""

    admission: bool = True  # wait in the gateway's priority queue when the pool is saturated
    budget_routing: bool = False  # prefer a replica predicted to meet the TTFT budget
    hedge: HedgeConfig = HedgeConfig()
    cap_output: bool = False  # lower max_tokens so TTFT + tokens x ITL fits total_ms
    deadline: bool = False  # past total_ms, stop the upstream and end the response


class Budget(Strict):
    ttft_ms: float | None = Field(None, gt=0, le=MAX_MS)
    itl_ms: float | None = Field(None, gt=0, le=MAX_MS)
    total_ms: float | None = Field(None, gt=0, le=MAX_MS)
    percentile: float = Field(95.0, gt=0, lt=100)

    @field_validator("percentile", mode="before")
    @classmethod
    def _pxx(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower().startswith("p"):
            return float(value[1:])
        return value


class SurfaceMatch(Strict):
    header: str | None = None  # the value of the X-Surface request header
    tenants: list[str] = []


class SurfaceLimits(RateLimits):
    """Limits per tenant on the surface, and what a request reserves against tokens_per_minute
    when it gives no max_tokens: its prompt's estimate plus ``expected_output_tokens``."""

    expected_output_tokens: int = Field(256, ge=1, le=10_000_000)


class Surface(Strict):
    match: SurfaceMatch = SurfaceMatch()
    budget: Budget = Budget()
    priority: Priority = "standard"
    actions: SurfaceActions = SurfaceActions()
    cache: CachePolicy | None = None  # exact and semantic caching of this surface's answers
    limits: SurfaceLimits | None = None


def action_errors(actions: SurfaceActions, budget: Budget) -> list[str]:
    """Cross-field rules between a surface's actions and its budget (empty when consistent)."""
    errors: list[str] = []
    if actions.cap_output and budget.total_ms is None:
        errors.append("actions.cap_output needs budget.total_ms")
    if actions.deadline and budget.total_ms is None:
        errors.append("actions.deadline needs budget.total_ms")
    if actions.budget_routing and budget.ttft_ms is None:
        errors.append("actions.budget_routing needs budget.ttft_ms")
    hedge = actions.hedge
    if (
        hedge.enabled
        and isinstance(hedge.delay_ms, float | int)
        and budget.ttft_ms is not None
        and hedge.delay_ms > budget.ttft_ms
    ):
        errors.append("actions.hedge.delay_ms must not exceed budget.ttft_ms")
    return errors
