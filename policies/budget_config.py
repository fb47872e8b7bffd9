"""Policy settings of the budgets work: surface priority and actions, admission, telemetry.

Frozen models that forbid unknown keys, embedded in ``policies.schema``:

```yaml
admission:                        # top level: how each backend's admission queue behaves
  max_outstanding_per_replica: 64 # saturated when the gateway has this many in flight per replica
  max_waiting: 0                  # ... or when every replica's scraped vLLM queue exceeds this
  queue_timeout_s: 30             # nobody waits longer than this (then 503 + Retry-After)
  max_queue: 10000                # beyond this many waiting, refuse at once
  aging_s: 10                     # each aging_s of waiting counts as one priority class
telemetry:
  enabled: false
  endpoint: null                  # default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, then localhost
  protocol: null                  # http | grpc; default: OTEL_EXPORTER_OTLP_PROTOCOL, then http
  service_name: null              # default: OTEL_SERVICE_NAME, then "llm-gateway"
  record_content: false           # prompt and completion text in spans: only if true
surfaces:
  voice:
    priority: interactive         # interactive | standard | background
    actions: {admission: true, budget_routing: true, cap_output: false, deadline: true,
              hedge: {enabled: true, delay_ms: auto, max_fraction: 0.1}}
```

This module imports nothing from ``policies.schema`` (the schema imports it).
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

Priority = Literal["interactive", "standard", "background"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "standard", "background")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HedgeConfig(_Frozen):
    """Send the request to a second replica when the first token is late.

    ``delay_ms: auto`` waits for the other replicas' recent TTFT p90 (their p50 when the
    primary is known to be slow; never past the surface's ``ttft_ms``); a number fixes it.
    ``max_fraction`` bounds hedges to that share of the surface's requests (a token bucket).
    """

    enabled: bool = False
    delay_ms: float | Literal["auto"] = "auto"
    max_fraction: float = Field(0.1, gt=0, le=1)
    min_delay_ms: float = Field(10.0, ge=0)  # "auto" never hedges sooner than this

    @field_validator("delay_ms")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if isinstance(value, float | int) and value <= 0:
            raise ValueError("delay_ms must be > 0 or 'auto'")
        return value


class SurfaceActions(_Frozen):
    """Which enforcement actions run for a surface; each one is switchable on its own."""

    admission: bool = True  # wait in the gateway's priority queue when the pool is saturated
    budget_routing: bool = False  # prefer a replica predicted to meet the TTFT budget
    hedge: HedgeConfig = HedgeConfig()
    cap_output: bool = False  # lower max_tokens so TTFT + tokens x ITL fits total_ms
    deadline: bool = False  # past total_ms, stop the upstream and end the response


class AdmissionConfig(_Frozen):
    max_outstanding_per_replica: int = Field(64, ge=1)
    # vLLM's scraped ``num_requests_waiting`` above this on every replica also saturates the
    # pool; None ignores the scraped queue.
    max_waiting: int | None = Field(0, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    max_queue: int = Field(10_000, ge=0)
    aging_s: float = Field(10.0, gt=0)


class TelemetryConfig(_Frozen):
    enabled: bool = False
    endpoint: str | None = None
    protocol: Literal["http", "grpc"] | None = None
    service_name: str | None = None
    record_content: bool = False
    # Share of requests traced when the caller sent no traceparent (a caller's sampled flag is
    # always followed). Every traced request costs ~0.3 ms of CPU: see the README.
    sample_ratio: float = Field(0.01, ge=0, le=1)
    # Unsampled requests that fail (5xx) or breach their budget are traced all the same (a
    # root span without children), at most failure_traces_per_s a second.
    trace_failures: bool = True
    failure_traces_per_s: float = Field(10.0, ge=0)
    headers: dict[str, str] = {}  # sent with every export (e.g. a collector's auth header)

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL: {value!r}")
        return value.rstrip("/") if value is not None else None


class BudgetLike(Protocol):
    @property
    def ttft_ms(self) -> float | None: ...

    @property
    def total_ms(self) -> float | None: ...


def action_errors(actions: SurfaceActions, budget: BudgetLike) -> list[str]:
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
