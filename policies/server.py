"""Process-wide sections: ``server``, ``admission``, ``telemetry``, ``shared_state`` and
``responses_store``.

```yaml
server:
  max_body_bytes: 67108864        # 64 MiB: 413 above this, on the wire and once decoded
  max_inflate_ratio: 20           # a gzip/deflate body may decode to 20x its size (past 1 MiB)
  max_response_bytes: 67108864    # a non-streamed upstream answer above this is a 502
  header_timeout_s: 15            # the request line and headers must arrive within this (408)
  body_timeout_s: 60              # the whole request body must arrive within this (408)
  keepalive_timeout_s: 75         # a connection idle between requests is closed after this
                                  # (a head awaited or arriving has header_timeout_s instead)
  max_client_connections: 1024    # open client connections; beyond: the oldest idle one closes,
                                  # or 503 when none is idle (capped by the open-file limit)
  admin_token_env: null           # a variable holding the admin token (/admin/*: Bearer token)
  metrics_token_env: null         # a variable holding a token /metrics then asks for (Bearer):
                                  # its labels name tenants, their spend, replica addresses
  access_log: false               # one line per request: no prompt, no key
  cors: null                      # {allow_origins: ["https://app.example"], ...} for browsers
  surface_header: X-Surface       # the request header that selects a surface
  retry_after_s: 2                # Retry-After on a 503 no_healthy_replica, upstream_saturated,
                                  # store_unavailable (admission's 503 estimates its own, 1-60 s)
  route_detail_headers: false     # true: answers say x-gateway-route-reason and
                                  # x-gateway-prefix-match (debugging: the prefix index is
                                  # shared, so they tell a caller what others' prompts hold)
admission:                        # how each backend's admission queue behaves
  max_outstanding_per_replica: 64 # saturated when the gateway has this many in flight per replica
  max_waiting: 0                  # ... or when every replica's scraped vLLM queue exceeds this
  queue_timeout_s: 30             # nobody waits longer than this (then 503 + Retry-After: the
                                  # requests queued / recent admissions a second, 1-60 s)
  max_queue: 10000                # beyond this many waiting, refuse at once
  aging_s: 10                     # each aging_s of waiting counts as one priority class
telemetry:
  enabled: false
  endpoint: null                  # default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, then localhost
  protocol: null                  # http | grpc; default: OTEL_EXPORTER_OTLP_PROTOCOL, then http
  service_name: null              # default: OTEL_SERVICE_NAME, then "llm-gateway"
  record_content: false           # prompt and completion text in spans: only if true
shared_state:
  redis_url: ${REDIS_URL:-}       # empty: in-process state, one instance
  timeout_ms: 500                 # a limit check slower than this counts as Redis unavailable
  limits_failure_mode: open       # Redis unavailable: open (admit unlimited) | closed (503)
  lease_ttl_s: 30                 # a crashed instance's max_concurrent slots come back after this
  grant_requests: 16              # far from every limit, a check takes this many more (0: off)
  grant_ttl_ms: 250               # ... admitted from memory within this, the rest given back
responses_store:                  # stored Responses API responses (previous_response_id)
  ttl_s: 2592000                  # 30 days
  max_entries: 10000              # per tenant, the oldest go first
  max_record_bytes: 4194304       # a conversation longer than this is served, not stored
  max_total_bytes: 268435456      # in this process (without shared_state.redis_url)
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies import redact
from policies.strict import Strict


def redis_url(value: str | None) -> str | None:
    """A redis:// URL, or None for an empty value."""
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"not a redis:// URL: {redact.url(value)!r}")
    return value or None


MIB = 1024 * 1024


class CorsConfig(Strict):
    """CORS for browser clients: off unless the ``cors`` section is given."""

    allow_origins: list[str] = Field(min_length=1)  # exact origins, or ["*"]
    allow_headers: list[str] = [
        "Authorization",
        "Content-Type",
        "X-Request-Id",
        "X-Surface",
        "X-Session-Id",
        "OpenAI-Organization",
        "OpenAI-Project",
        "OpenAI-Beta",
        "X-Stainless-*",  # openai-js and anthropic-js: X-Stainless-Lang, -OS, -Retry-Count...
        "X-Api-Key",
        "Anthropic-Version",
        "Anthropic-Beta",
        "Anthropic-Dangerous-Direct-Browser-Access",
    ]  # a name ending in "*" allows every header it begins (a preflight's are echoed back)
    # (server.surface_header is allowed besides, whatever this list says: gateway.middleware)
    expose_headers: list[str] = [
        "x-request-id",
        "request-id",
        "x-gateway-cache",
        "x-gateway-replica",
    ]
    max_age_s: int = Field(600, ge=0)
    allow_credentials: bool = False

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"an origin is '*' or an http(s) URL: {origin!r}")
            if origin.endswith("/"):
                raise ValueError(f"an origin has no path (drop the trailing '/'): {origin!r}")
        return value

    @model_validator(mode="after")
    def _credentials(self) -> CorsConfig:
        if self.allow_credentials and "*" in self.allow_origins:
            raise ValueError(
                "allow_credentials with allow_origins '*': browsers refuse credentials for a "
                "wildcard origin; list the origins"
            )
        return self

    def allows_header(self, name: str) -> bool:
        lowered = name.strip().lower()
        for allowed in self.allow_headers:
            pattern = allowed.lower()
            if lowered == pattern or (pattern.endswith("*") and lowered.startswith(pattern[:-1])):
                return True
        return False


class ServerConfig(Strict):
    # 64 MiB: OpenAI takes up to 50 MB of images per request (20 MB each), about 67 MB as the
    # base64 that a JSON body carries.
    max_body_bytes: int = Field(64 * MIB, ge=1024)
    max_inflate_ratio: float = Field(20.0, ge=1.0)
    max_response_bytes: int = Field(64 * MIB, ge=1024)
    header_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    keepalive_timeout_s: float = Field(75.0, gt=0)
    max_client_connections: int = Field(1024, ge=1)
    admin_token_env: str | None = Field(None, min_length=1)
    metrics_token_env: str | None = Field(None, min_length=1)
    access_log: bool = False
    cors: CorsConfig | None = None
    surface_header: str = "X-Surface"
    retry_after_s: int = Field(2, ge=1)
    # Why a replica was chosen and how much of the prompt it holds: the prefix index serves
    # every tenant, so a match length answers "does another tenant's prompt begin with this?"
    # one chunk at a time. Off by default; spans and metrics carry the decision either way.
    route_detail_headers: bool = False


class AdmissionConfig(Strict):
    max_outstanding_per_replica: int = Field(64, ge=1)
    # vLLM's scraped ``num_requests_waiting`` above this on every replica also saturates the
    # pool; None ignores the scraped queue.
    max_waiting: int | None = Field(0, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    max_queue: int = Field(10_000, ge=0)
    aging_s: float = Field(10.0, gt=0)


class TelemetryConfig(Strict):
    enabled: bool = False
    endpoint: str | None = None
    protocol: Literal["http", "grpc"] | None = None
    service_name: str | None = None
    record_content: bool = False
    # Share of requests traced when the caller sent no traceparent (a caller's sampled flag is
    # always followed). A traced request costs tens of microseconds (README, "Tracing"), so a
    # tenth of the traffic costs about a hundredth of the request rate.
    sample_ratio: float = Field(0.1, ge=0, le=1)
    # Unsampled requests that fail (5xx) or breach their budget are traced all the same (a
    # root span without children), at most failure_traces_per_s a second.
    trace_failures: bool = True
    failure_traces_per_s: float = Field(10.0, ge=0)
    headers: dict[str, str] = {}  # sent with every export (e.g. a collector's auth header)

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL: {redact.url(value)!r}")
        return value.rstrip("/") if value is not None else None


class ResponsesStoreConfig(Strict):
    """Stored Responses API responses (``store``, ``previous_response_id``, GET /v1/responses):
    in ``shared_state.redis_url`` when set, else in this process."""

    ttl_s: int = Field(30 * 24 * 3600, ge=1)  # OpenAI keeps stored responses 30 days
    max_entries: int = Field(10_000, ge=1)  # per tenant; the oldest go first
    max_record_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # a longer conversation is not stored
    max_total_bytes: int = Field(256 * 1024 * 1024, ge=1024)  # in this process, all tenants


class SharedStateConfig(Strict):
    """State shared by every gateway instance: tenant limits, budgets and usage; the cache uses
    it unless ``cache_store`` says otherwise."""

    redis_url: str | None = None
    # Above the event loop's lag under load: a loop too busy to read Redis's answer in time
    # would otherwise read as Redis being down (and the limits would fail open or closed).
    timeout_ms: float = Field(500.0, gt=0, le=60_000)
    limits_failure_mode: Literal["open", "closed"] = "open"
    lease_ttl_s: float = Field(30.0, ge=1, le=3600)
    # With Redis: a check made far from every limit also takes this many more requests' worth
    # for this instance's next requests of the tenant, admitted in memory until used or
    # grant_ttl_ms has passed, then given back (gateway.limits.grants); 0: every limited
    # request asks Redis.
    grant_requests: int = Field(16, ge=0, le=256)
    grant_ttl_ms: float = Field(250.0, gt=0, le=10_000)

    _url = field_validator("redis_url")(classmethod(lambda cls, v: redis_url(v)))
