"""Policy schema v1: the top-level document, one strict section per module.

| section        | module                 |
|----------------|------------------------|
| server, admission, telemetry, shared_state | policies/server.py |
| backends       | policies/backends.py (routing: policies/routing.py) |
| models         | policies/models.py     |
| tenants        | policies/tenants.py    |
| surfaces       | policies/surfaces.py   |
| cache_store    | policies/cache.py      |

Cross-field rules that need the whole document (a model alias naming a missing backend, a
surface naming a missing tenant) live in ``policies.loader.cross_check`` so that each error can
name the exact key path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policies.backends import Backend
from policies.cache import CacheStoreConfig
from policies.models import ModelEntry, TieredModelConfig
from policies.server import (
    AdmissionConfig,
    ResponsesStoreConfig,
    ServerConfig,
    SharedStateConfig,
    TelemetryConfig,
)
from policies.strict import Strict
from policies.surfaces import Surface
from policies.tenants import Tenant


class Policy(Strict):
    version: Literal[1] = 1
    server: ServerConfig = ServerConfig()
    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelEntry] = {}
    tenants: dict[str, Tenant] = {}
    surfaces: dict[str, Surface] = {}
    admission: AdmissionConfig = AdmissionConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    shared_state: SharedStateConfig = SharedStateConfig()
    cache_store: CacheStoreConfig = CacheStoreConfig()
    responses_store: ResponsesStoreConfig = ResponsesStoreConfig()

    def needs_cache(self) -> bool:
        return any(s.cache is not None for s in self.surfaces.values())

    def needs_embeddings(self) -> bool:
        """Semantic caching or a tiered model: the gateway then loads the embedding model."""
        return any(
            s.cache is not None and s.cache.semantic is not None for s in self.surfaces.values()
        ) or any(isinstance(m, TieredModelConfig) for m in self.models.values())

    def has_tenant_limits(self) -> bool:
        """Rate limits or a budget anywhere: state that must be shared to hold exactly."""
        return any(
            t.limits is not None or t.budget is not None for t in self.tenants.values()
        ) or any(s.limits is not None for s in self.surfaces.values())

    def cache_redis_url(self) -> str | None:
        """The cache's Redis: its own ``cache_store.redis_url``, else the shared one."""
        return self.cache_store.redis_url or self.shared_state.redis_url
