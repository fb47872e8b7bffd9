"""From the policy to the limiter's rules: who is bound by what, and what a model costs.

Built once per runtime (a reload builds new rules; the limiter and its counters stay). A
request's ``Subject`` (its tenant's limits and budget, the limits of the tenant on its surface)
is looked up, not built, on the hot path: the pairs are few (tenants x surfaces, both from the
policy) and cached on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.limits.cost import Price
from gateway.limits.rules import BudgetRule, RateLimits, Subject
from policies import models as policy_models
from policies import tenants as policy_tenants
from policies.schema import Policy

DEFAULT_EXPECTED_OUTPUT = 256


def price_of(price: policy_models.Price | None) -> Price | None:
    if price is None:
        return None
    return Price.per_mtok(price.input_per_mtok, price.output_per_mtok, price.cached_input_per_mtok)


def _limits(limits: policy_tenants.RateLimits | None) -> RateLimits | None:
    if limits is None:
        return None
    rules = RateLimits(limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent)
    return rules if rules else None


def _budget(budget: policy_tenants.SpendBudget | None) -> BudgetRule | None:
    if budget is None:
        return None
    return BudgetRule(budget.usd, budget.window, tuple(budget.alert_at), budget.on_exhausted)


@dataclass
class LimitRules:
    policy: Policy
    _subjects: dict[tuple[str, str], Subject] = field(default_factory=dict)

    def subject(self, tenant: str, surface: str) -> Subject:
        key = (tenant, surface)
        found = self._subjects.get(key)
        if found is None:
            spec = self.policy.tenants.get(tenant)
            where = self.policy.surfaces.get(surface)
            found = self._subjects[key] = Subject(
                tenant,
                surface,
                _limits(spec.limits) if spec is not None else None,
                _limits(where.limits) if where is not None else None,
                _budget(spec.budget) if spec is not None else None,
            )
        return found

    def expected_output(self, surface: str) -> int:
        where = self.policy.surfaces.get(surface)
        if where is None or where.limits is None:
            return DEFAULT_EXPECTED_OUTPUT
        return where.limits.expected_output_tokens

    def downgrade_to(self, tenant: str) -> str | None:
        spec = self.policy.tenants.get(tenant)
        return spec.budget.downgrade_to if spec is not None and spec.budget else None

    @property
    def tenants(self) -> list[str]:
        return list(self.policy.tenants) or ["anonymous"]

    @property
    def surfaces(self) -> list[str]:
        return [
            *self.policy.surfaces,
            *(["default"] if "default" not in self.policy.surfaces else []),
        ]
