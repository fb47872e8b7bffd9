"""Backends: a pool of vLLM replicas, an OpenAI-compatible API, or Anthropic's Messages API.

```yaml
backends:
  pool:
    kind: vllm
    replicas: ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    health: {active: true, interval_s: 5, timeout_s: 2, eject_after: 3, cooldown_s: 10}
    timeouts: {connect_s: 3, first_byte_s: 120, idle_s: 120, total_s: 900}
    max_connections: 1000          # open connections per replica
    http_client: lean              # vllm only: the gateway's HTTP/1.1 client (or aiohttp)
    rate_limit_wait_s: 2           # wait for the provider's rate limit reset, then fall back
    routing: {strategy: least_loaded}   # policies/routing.py
  openai: {kind: openai, base_url: https://api.openai.com/v1, api_key_env: OPENAI_API_KEY}
  claude: {kind: anthropic, api_key_env: ANTHROPIC_API_KEY}
```
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator
from yarl import URL

from policies import redact
from policies.routing import LeastLoadedRouting, RoutingConfig
from policies.strict import Strict

_URL = re.compile(r"^https?://[^/\s]+(/\S*)?$")


def _check_url(value: str) -> str:
    """An http(s) base URL that serving can use: the same parser as the HTTP clients (yarl),
    a host, a port in 1-65535, no query or fragment, no credentials."""
    shown = redact.url(value)
    if not _URL.match(value):
        raise ValueError(f"not an http(s) URL: {shown!r}")
    try:
        url = URL(value)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"not a usable URL: {shown!r} ({exc})") from None
    if not url.host:
        raise ValueError(f"no host in the URL: {shown!r}")
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"the port must be 1 to 65535: {shown!r}")
    if url.query_string or url.fragment or "?" in value or "#" in value:
        raise ValueError(f"a base URL takes no query or fragment (? or #): {shown!r}")
    if redact.has_userinfo(value):  # user:password@host: it would name the replica everywhere
        raise ValueError(
            f"credentials in a URL ({shown!r}): give the key with api_key or "
            "api_key_env, never in the URL (it names the replica in headers, metrics and logs)"
        )
    return value.rstrip("/")


class HealthConfig(Strict):
    """Active checks call ``/health`` every ``interval_s``; passive ejection after failures."""

    active: bool = True
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    eject_after: int = Field(3, ge=1)
    cooldown_s: float = Field(10.0, gt=0)


class TimeoutConfig(Strict):
    connect_s: float = Field(3.0, gt=0)
    first_byte_s: float = Field(120.0, gt=0)  # until the upstream's response headers
    idle_s: float = Field(120.0, gt=0)  # longest silence between two reads of the body
    total_s: float = Field(900.0, gt=0)  # from sending the request to the end of the answer

    @model_validator(mode="after")
    def _ordered(self) -> TimeoutConfig:
        if self.first_byte_s > self.total_s:
            raise ValueError("first_byte_s must not exceed total_s")
        return self


class _BackendBase(Strict):
    timeouts: TimeoutConfig = TimeoutConfig()
    max_connections: int = Field(1000, ge=1)  # open connections per replica (host:port)
    # When the backend's x-ratelimit-* headers say its budget is spent, a request waits up to
    # this long for the reset before it goes to the next target (0: go at once).
    rate_limit_wait_s: float = Field(2.0, ge=0, le=300)


# Checked item by item, so that a bad URL's error names its own line.
ReplicaUrl = Annotated[str, AfterValidator(_check_url)]

# Which client sends a vLLM backend's requests to its http:// replicas: the gateway's own lean
# HTTP/1.1 client (routing/http1.py), or aiohttp's (https replicas always use aiohttp's).
HttpClient = Literal["lean", "aiohttp"]

# How POST /v1/responses reaches a backend: translated onto chat completions (every stage
# applies), or relayed to the backend's own /v1/responses (vLLM and OpenAI serve it).
ResponsesMode = Literal["translate", "passthrough"]


class VllmBackend(_BackendBase):
    kind: Literal["vllm"]
    replicas: list[ReplicaUrl] = Field(min_length=1)
    api_key: str | None = None  # vLLM's --api-key, if the replicas require one
    discover_models: bool = True  # expose every model the replicas list under its own name
    health: HealthConfig = HealthConfig()
    routing: RoutingConfig = Field(default_factory=LeastLoadedRouting)
    responses: ResponsesMode = "translate"
    http_client: HttpClient = "lean"

    @field_validator("replicas")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("replica URLs must be unique")
        return value


class OpenAIBackend(_BackendBase):
    """Any OpenAI-compatible external API (OpenAI itself, Together, a remote vLLM...)."""

    kind: Literal["openai"]
    base_url: str
    api_key_env: str | None = None  # name of the environment variable holding the key
    discover_models: bool = False
    health: HealthConfig = HealthConfig(active=False)
    responses: ResponsesMode = "translate"

    _base = field_validator("base_url")(classmethod(lambda cls, v: _check_url(v)))

    @field_validator("health", mode="before")
    @classmethod
    def _passive_unless_asked(cls, value: Any) -> Any:
        """Active checks only with ``active: true``: most OpenAI-compatible APIs have no
        ``/health``, and a block that only tunes ejection must not make the backend unready."""
        if isinstance(value, dict) and "active" not in value:
            return {**value, "active": False}
        return value


class AnthropicBackend(_BackendBase):
    """Anthropic's Messages API: chat requests and answers are translated (gateway/upstream/providers)."""

    kind: Literal["anthropic"]
    base_url: str = "https://api.anthropic.com/v1"
    api_key_env: str | None = None  # name of the environment variable holding the key
    default_max_tokens: int = Field(4096, ge=1)  # Anthropic requires max_tokens; sent when absent
    health: HealthConfig = HealthConfig(active=False)

    _base = field_validator("base_url")(classmethod(lambda cls, v: _check_url(v)))

    @field_validator("health", mode="before")
    @classmethod
    def _passive(cls, value: Any) -> Any:
        """No active checks (there is no health endpoint): ejection after failures only."""
        if isinstance(value, dict):
            if value.get("active"):
                raise ValueError("anthropic backends have no health endpoint: active must be false")
            return {**value, "active": False}
        return value

    @property
    def discover_models(self) -> bool:
        return False  # the aliases in `models` name what this backend serves


Backend = Annotated[VllmBackend | OpenAIBackend | AnthropicBackend, Field(discriminator="kind")]
