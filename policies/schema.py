"""Policy schema v1: frozen models that forbid unknown keys.

Cross-field rules that need the whole document (a model alias naming a missing backend, a
surface naming a missing tenant) live in ``policies.loader.cross_check`` so that each error can
name the exact key path.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from cache.config import CachePolicy
from policies.budget_config import AdmissionConfig, Priority, SurfaceActions, TelemetryConfig
from routing.config import LeastLoadedRouting, RoutingConfig
from routing.tier_config import TieredModelConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_URL = re.compile(r"^https?://[^/\s]+(/\S*)?$")


def _check_url(value: str) -> str:
    if not _URL.match(value):
        raise ValueError(f"not an http(s) URL: {value!r}")
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
    total_s: float = Field(900.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> TimeoutConfig:
        if self.first_byte_s > self.total_s:
            raise ValueError("first_byte_s must not exceed total_s")
        return self


class VllmBackend(Strict):
    kind: Literal["vllm"]
    replicas: list[str] = Field(min_length=1)
    api_key: str | None = None  # vLLM's --api-key, if the replicas require one
    discover_models: bool = True  # expose every model the replicas list under its own name
    health: HealthConfig = HealthConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    routing: RoutingConfig = Field(
        default_factory=lambda: LeastLoadedRouting(strategy="least_loaded")
    )
    max_connections: int = Field(1000, ge=1)

    @field_validator("replicas")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        urls = [_check_url(v) for v in value]
        if len(set(urls)) != len(urls):
            raise ValueError("replica URLs must be unique")
        return urls


class OpenAIBackend(Strict):
    """Any OpenAI-compatible external API (OpenAI itself, Together, a remote vLLM...)."""

    kind: Literal["openai"]
    base_url: str
    api_key_env: str | None = None  # name of the environment variable holding the key
    discover_models: bool = False
    health: HealthConfig = HealthConfig(active=False)
    timeouts: TimeoutConfig = TimeoutConfig()
    max_connections: int = Field(1000, ge=1)

    _base = field_validator("base_url")(classmethod(lambda cls, v: _check_url(v)))


class AnthropicBackend(Strict):
    """Anthropic's Messages API: chat requests and answers are translated (gateway/providers)."""

    kind: Literal["anthropic"]
    base_url: str = "https://api.anthropic.com/v1"
    api_key_env: str | None = None  # name of the environment variable holding the key
    default_max_tokens: int = Field(4096, ge=1)  # Anthropic requires max_tokens; sent when absent
    health: HealthConfig = HealthConfig(active=False)
    timeouts: TimeoutConfig = TimeoutConfig()
    max_connections: int = Field(1000, ge=1)

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


class Target(Strict):
    backend: str
    model: str | None = None  # the name sent upstream; default: the public alias

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value


class ModelRoute(Strict):
    backend: str
    model: str | None = None  # upstream model name; default: the alias (or the only one served)
    fallbacks: list[Target] = []


def _model_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "tiered" if "tiers" in value else "route"
    return "tiered" if isinstance(value, TieredModelConfig) else "route"


# A model alias either names a backend (with fallbacks) or is tiered (small/large, routed by
# difficulty or cascaded): see routing/tier_config.py.
ModelEntry = Annotated[
    Annotated[ModelRoute, Tag("route")] | Annotated[TieredModelConfig, Tag("tiered")],
    Discriminator(_model_kind),
]


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class Tenant(Strict):
    api_keys: list[str] = []  # plaintext keys, only from ${ENV_VARS}
    api_key_sha256: list[str] = []  # hex digests of keys

    @field_validator("api_keys")
    @classmethod
    def _nonempty(cls, value: list[str]) -> list[str]:
        for key in value:
            if len(key) < 8:
                raise ValueError("an API key must have at least 8 characters")
        return value

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not _HEX64.match(digest):
                raise ValueError(f"not a lowercase hex sha256 digest: {digest!r}")
        return value


class Budget(Strict):
    ttft_ms: float | None = Field(None, gt=0)
    itl_ms: float | None = Field(None, gt=0)
    total_ms: float | None = Field(None, gt=0)
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


class Surface(Strict):
    match: SurfaceMatch = SurfaceMatch()
    budget: Budget = Budget()
    priority: Priority = "standard"
    actions: SurfaceActions = SurfaceActions()
    cache: CachePolicy | None = None  # exact and semantic caching of this surface's answers


class CacheStoreConfig(Strict):
    """Where cache entries live: in memory (one gateway instance) or in Redis (shared)."""

    redis_url: str | None = None  # e.g. ${REDIS_URL}; None or "": in memory
    timeout_ms: float = Field(50.0, gt=0)  # a slower store is skipped, the request goes on
    prefix: str = "lgw:cache"
    embedder_backend: Literal["auto", "onnx", "torch"] = "auto"
    # Threads one embedding may use; None: min(2, the cores this process may run on). Two
    # threads halve a single query's embedding time here (8.5 -> 4.8 ms for a 27-token text).
    embedder_threads: int | None = Field(None, ge=1, le=64)

    @field_validator("redis_url")
    @classmethod
    def _redis(cls, value: str | None) -> str | None:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"not a redis:// URL: {value!r}")
        return value or None


class ServerConfig(Strict):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    surface_header: str = "X-Surface"
    retry_after_s: int = Field(2, ge=1)


class Policy(Strict):
    version: Literal[1] = 1
    server: ServerConfig = ServerConfig()
    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelEntry] = {}
    tenants: dict[str, Tenant] = {}
    surfaces: dict[str, Surface] = {}
    admission: AdmissionConfig = AdmissionConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    cache_store: CacheStoreConfig = CacheStoreConfig()

    def needs_embeddings(self) -> bool:
        """Semantic caching or a tiered model: the gateway then loads the embedding model."""
        return any(
            s.cache is not None and s.cache.semantic is not None for s in self.surfaces.values()
        ) or any(isinstance(m, TieredModelConfig) for m in self.models.values())
