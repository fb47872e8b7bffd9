"""Cache settings: a surface's ``cache`` section and the top-level ``cache_store``.

```yaml
cache:
  exact: true
  exact_ttl: 3600
  namespace: support-bot        # default: the surface's name
  allow_temperature: false      # cache requests with temperature > 0 too
  semantic:
    gate: verifier              # or "cosine": the threshold alone decides
    threshold: 0.70             # cosine floor for candidates (default: the artifact's)
    ttl: 3600
    max_entries: 100000
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from policies.server import redis_url
from policies.strict import Strict


class SemanticCacheConfig(Strict):
    threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="cosine similarity a stored entry needs to be a candidate; with "
        "gate=cosine it is the whole decision. None: the verifier artifact's floor "
        "(gate=verifier) or 0.92 (gate=cosine)",
    )
    gate: Literal["verifier", "cosine"] = "verifier"
    verifier_threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="minimum verifier probability; None takes the one shipped in the artifact",
    )
    ttl: int = Field(default=3600, gt=0, description="seconds an entry lives")
    max_entries: int = Field(
        default=100_000, gt=0, description="per scope; the entries closest to expiry go first"
    )
    top_k: int = Field(default=4, ge=1, le=64, description="candidates the gate examines")


class CachePolicy(Strict):
    exact: bool = True
    exact_ttl: int = Field(default=3600, gt=0)
    semantic: SemanticCacheConfig | None = None
    namespace: str | None = Field(
        default=None, min_length=1, max_length=128, description="default: the surface's name"
    )
    allow_temperature: bool = Field(
        default=False,
        description="also cache requests whose temperature is above 0 or absent (the "
        "OpenAI default is 1)",
    )

    @property
    def enabled(self) -> bool:
        return self.exact or self.semantic is not None


COSINE_ONLY_DEFAULT_THRESHOLD = 0.92


class CacheStoreConfig(Strict):
    """Where cache entries live: in memory (one gateway instance) or in Redis (shared)."""

    redis_url: str | None = None  # None or "": shared_state.redis_url, else in memory
    timeout_ms: float = Field(50.0, gt=0)  # a slower store is skipped, the request goes on
    prefix: str = "lgw:cache"
    embedder_backend: Literal["auto", "onnx", "torch"] = "auto"
    # Threads one embedding may use; None: min(2, the cores this process may run on). Two
    # threads halve a single query's embedding time here (8.5 -> 4.8 ms for a 27-token text).
    embedder_threads: int | None = Field(None, ge=1, le=64)

    _url = field_validator("redis_url")(classmethod(lambda cls, v: redis_url(v)))
