"""Model aliases: a backend with fallbacks, or two tiers routed by difficulty or cascaded.

```yaml
models:
  smart:
    backend: pool
    model: meta-llama/Llama-3.1-70B-Instruct   # the name sent upstream
    price: {input_per_mtok: 0.15, output_per_mtok: 0.60, cached_input_per_mtok: 0.075}
    fallbacks: [{backend: openai, model: gpt-4o,  # tried in order; a bare name also works
                 price: {input_per_mtok: 2.5, output_per_mtok: 10}}]
```

``price`` is in USD per million tokens, at most six decimals; a fallback or a tier without its
own price costs what its alias's ``price`` says. A model without a price costs nothing against
budgets (its tokens are still counted).

A tiered alias:

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

from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Literal, Protocol

from pydantic import Discriminator, Field, PositiveInt, Tag, model_validator

from policies.strict import Strict

CalibrationKind = Literal["max_large_fraction", "min_quality_recovered"]
CALIBRATION_KINDS: tuple[CalibrationKind, ...] = ("max_large_fraction", "min_quality_recovered")


@dataclass(frozen=True)
class CalibrationTarget:
    """What a tiered alias aims at instead of a fixed threshold (turned into one at load)."""

    kind: CalibrationKind
    value: float

    def __str__(self) -> str:
        return f"{self.kind}={self.value:g}"


class Price(Strict):
    """USD per million tokens; cached input defaults to the input price."""

    input_per_mtok: Decimal = Field(ge=0, le=Decimal(10**6), decimal_places=6)
    output_per_mtok: Decimal = Field(ge=0, le=Decimal(10**6), decimal_places=6)
    cached_input_per_mtok: Decimal | None = Field(None, ge=0, le=Decimal(10**6), decimal_places=6)


class ModelTarget(Strict):
    """A backend and the model name sent to it (default: the public alias)."""

    backend: str = Field(min_length=1)
    model: str | None = None
    price: Price | None = None  # default: the alias's price

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value


class ModelRoute(Strict):
    backend: str
    model: str | None = None  # upstream model name; default: the alias (or the only one served)
    fallbacks: list[ModelTarget] = []
    price: Price | None = None


class CommitPoint(Strict):
    tokens: PositiveInt | Literal["whole"] = "whole"

    @property
    def whole(self) -> bool:
        return self.tokens == "whole"


class _Calibrated(Protocol):
    @property
    def threshold(self) -> float: ...

    def threshold_for(self, target: CalibrationTarget) -> float: ...


class TieredModelConfig(Strict):
    tiers: tuple[ModelTarget, ModelTarget]  # (small, large); each may carry its own price
    price: Price | None = None  # of a tier without its own
    mode: Literal["route", "cascade"] = "route"
    threshold: float | None = Field(None, ge=-1.0, le=1.0)  # scores are gains in [-1, 1]
    max_large_fraction: float | None = Field(None, ge=0.0, le=1.0)
    min_quality_recovered: float | None = Field(None, gt=0.0, le=1.0)
    commit: CommitPoint | None = None  # cascade only; default: the whole answer
    artifact: str | None = None  # a train-router artifact; default: the packaged one
    fallback_to_small: bool = True  # serve the held small answer if the large tier fails

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
    def small(self) -> ModelTarget:
        return self.tiers[0]

    @property
    def large(self) -> ModelTarget:
        return self.tiers[1]

    @property
    def commit_point(self) -> CommitPoint:
        return self.commit or CommitPoint()

    @property
    def target(self) -> CalibrationTarget | None:
        if self.max_large_fraction is not None:
            return CalibrationTarget("max_large_fraction", self.max_large_fraction)
        if self.min_quality_recovered is not None:
            return CalibrationTarget("min_quality_recovered", self.min_quality_recovered)
        return None

    def resolve_threshold(self, model: _Calibrated) -> float:
        """The threshold to apply with ``model`` (the estimator in route mode, else the verifier)."""
        if self.threshold is not None:
            return self.threshold
        target = self.target
        return model.threshold if target is None else model.threshold_for(target)


def _model_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "tiered" if "tiers" in value else "route"
    return "tiered" if isinstance(value, TieredModelConfig) else "route"


# A model alias either names a backend (with fallbacks) or is tiered.
ModelEntry = Annotated[
    Annotated[ModelRoute, Tag("route")] | Annotated[TieredModelConfig, Tag("tiered")],
    Discriminator(_model_kind),
]
