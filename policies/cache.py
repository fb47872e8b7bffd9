"""Cache settings: a surface's ``cache`` section and the top-level ``cache_store``.

```yaml
cache:
  exact: true
  exact_ttl: 3600
  namespace: support-bot        # default: the surface's name
  allow_temperature: false      # cache requests with temperature > 0 too
  semantic:
    gate: verifier              # or "cosine": the threshold alone decides
    threshold: 0.50             # cosine floor for candidates (default: the artifact's)
    max_false_hit_rate: 0.01    # the gate's operating point, from the shipped calibration
    min_precision: 0.98         # statement pairs' operating point (news-like prose)
    audit_fraction: 0.02        # share of semantic hits re-asked upstream (0: no audit)
    audit_per_minute: 30        # at most this many audits a minute (their upstream cost)
    ttl: 3600
    max_entries: 100000
  rules:                        # answers that do not generalise (cache/rules.py)
    tools: exact                # requests with tools or tool results: exact-only
    time: exact                 # "today", "now", "latest", ...: exact-only
    personal: off               # "my order", "my account balance", ...: not cached at all
```

A rule's value is ``semantic`` (the rule is off), ``exact`` (exact matches only: the same
request within ``exact_ttl``) or ``off`` (the request is neither looked up nor stored).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from policies.server import redis_url
from policies.strict import MAX_MS, Strict


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
        description="minimum request-gate probability (request pairs); None takes the "
        "operating point for max_false_hit_rate from the artifact",
    )
    max_false_hit_rate: float = Field(
        default=0.01,
        gt=0.0,
        le=0.5,
        description="the highest share of different questions the gate may serve another "
        "question's answer, as the one-sided 95% upper bound measured out of fold on the "
        "near-miss calibration set; picks the verifier's threshold from the artifact's table "
        "(ignored when verifier_threshold is set)",
    )
    min_precision: float = Field(
        default=0.98,
        ge=0.5,
        le=1.0,
        description="for statement pairs (both texts declarative prose, such as news "
        "sentences: cache/statements.py), the share of semantic hits that must be right, "
        "measured out of fold on the statement pairs of the news and question pairs; picks "
        "their threshold from the artifact's precision table (none reaches it: statement "
        "pairs are not served semantically)",
    )
    audit_fraction: float = Field(
        default=0.02,
        ge=0.0,
        le=1.0,
        description="share of semantic hits also sent upstream, in the background after the "
        "cached answer was served, to measure false hits in production; 0 turns it off",
    )
    audit_per_minute: int = Field(
        default=30,
        ge=0,
        le=100_000,
        description="at most this many audits per minute per gateway (the audit's upstream cost)",
    )
    audit_min_similarity: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="cosine of the two answers' embeddings below which an audited hit counts "
        "as a false hit (short or structured answers are compared exactly)",
    )
    ttl: int = Field(default=3600, gt=0, description="seconds an entry lives")
    max_entries: int = Field(
        default=100_000, gt=0, description="per scope; the entries closest to expiry go first"
    )
    top_k: int = Field(default=4, ge=1, le=64, description="candidates the gate examines")


RuleMode = Literal["semantic", "exact", "off"]


class CacheRules(Strict):
    """What happens to requests whose answer does not carry over to another request."""

    tools: RuleMode = Field(
        default="exact",
        description="requests offering tools, or carrying tool calls or results",
    )
    time: RuleMode = Field(
        default="exact",
        description="requests about the present moment: today, now, latest, current, ...",
    )
    personal: RuleMode = Field(
        default="off",
        description="requests about the user's own records: my order, my account balance, ...",
    )

    @field_validator("tools", "time", "personal", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as false: take it as the word it was meant to be.
        return "off" if value is False else value


class CachePolicy(Strict):
    exact: bool = True
    exact_ttl: int = Field(default=3600, gt=0)
    semantic: SemanticCacheConfig | None = None
    rules: CacheRules = Field(default_factory=CacheRules)
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
    timeout_ms: float = Field(
        50.0, gt=0, le=MAX_MS
    )  # a slower store is skipped, the request goes on
    # In memory only: the stored answers' bytes, exact and semantic together (least recently
    # used exact answers go first, then the oldest semantic entries). Redis: its maxmemory.
    max_memory_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    prefix: str = "lgw:cache"
    embedder_backend: Literal["auto", "onnx", "torch"] = "auto"
    # Threads one embedding may use; None: min(2, the cores this process may run on). Two
    # threads halve a single query's embedding time here (8.5 -> 4.8 ms for a 27-token text).
    embedder_threads: int | None = Field(None, ge=1, le=64)

    _url = field_validator("redis_url")(classmethod(lambda cls, v: redis_url(v)))
