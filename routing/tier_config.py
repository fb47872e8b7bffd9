"""Policy of a tiered model alias: a small and a large tier, routed or cascaded.

```yaml
models:
  auto:
    tiers: [small-pool, {backend: gpt, model: gpt-4o}]   # [small, large]
    mode: cascade                  # route (default) | cascade
    min_quality_recovered: 0.8     # or max_large_fraction: 0.3, or threshold: 0.05
    commit: {tokens: whole}        # cascade only: {tokens: 32} streams after 32 held tokens
```

With no threshold and no target the artifact's shipped threshold applies (calibrated on the
out-of-fold dev scores to recover 80 % of the quality gap). A target is turned into a threshold
by the artifact's calibration table at load time; ``llm-gateway calibrate`` gives the exact
threshold for your own labelled traffic, to put in ``threshold``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from routing.calibration import Target


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierTarget(_Strict):
    backend: str = Field(min_length=1)
    model: str | None = None  # the upstream model name; default: the alias


class CommitPoint(_Strict):
    tokens: PositiveInt | Literal["whole"] = "whole"

    @property
    def whole(self) -> bool:
        return self.tokens == "whole"


class _Calibrated(Protocol):
    @property
    def threshold(self) -> float: ...

    def threshold_for(self, target: Target) -> float: ...


class TieredModelConfig(_Strict):
    tiers: tuple[TierTarget, TierTarget]  # (small, large)
    mode: Literal["route", "cascade"] = "route"
    threshold: float | None = Field(None, ge=-1.0, le=1.0)  # scores are gains in [-1, 1]
    max_large_fraction: float | None = Field(None, ge=0.0, le=1.0)
    min_quality_recovered: float | None = Field(None, gt=0.0, le=1.0)
    commit: CommitPoint | None = None  # cascade only; default: the whole answer
    artifact: str | None = None  # a train-router artifact; default: the packaged one
    fallback_to_small: bool = True  # serve the held small answer if the large tier fails

    @model_validator(mode="before")
    @classmethod
    def _tier_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tiers"), list | tuple):
            data = {
                **data,
                "tiers": [{"backend": t} if isinstance(t, str) else t for t in data["tiers"]],
            }
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TieredModelConfig:
        if self.tiers[0] == self.tiers[1]:
            raise ValueError("the small and the large tier must differ")
        chosen = [
            name
            for name in ("threshold", "max_large_fraction", "min_quality_recovered")
            if getattr(self, name) is not None
        ]
        if len(chosen) > 1:
            raise ValueError(
                f"give at most one of threshold, max_large_fraction, "
                f"min_quality_recovered (got {', '.join(chosen)})"
            )
        if self.commit is not None and self.mode != "cascade":
            raise ValueError("commit applies to cascade mode only")
        return self

    @property
    def small(self) -> TierTarget:
        return self.tiers[0]

    @property
    def large(self) -> TierTarget:
        return self.tiers[1]

    @property
    def commit_point(self) -> CommitPoint:
        return self.commit or CommitPoint()

    @property
    def target(self) -> Target | None:
        if self.max_large_fraction is not None:
            return Target("max_large_fraction", self.max_large_fraction)
        if self.min_quality_recovered is not None:
            return Target("min_quality_recovered", self.min_quality_recovered)
        return None

    def resolve_threshold(self, model: _Calibrated) -> float:
        """The threshold to apply with ``model`` (the estimator in route mode, else the verifier)."""
        if self.threshold is not None:
            return self.threshold
        target = self.target
        return model.threshold if target is None else model.threshold_for(target)
