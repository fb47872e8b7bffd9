"""Usage records: what each finished request adds, budget alerts, and the usage report.

A finished request adds to its tenant's record for the current day, week and month: the total
spend and, per surface, requests, cache hits, input / cached input / output tokens and cost.
Budget alerts are decided on the store's answer: the record's spend after the addition. A
fraction ``f`` of the budget fires when ``before < f * cap <= after``; additions are atomic, so
exactly one addition crosses each threshold in a window, whichever instance made it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gateway.limits.cost import Usage, usd_text
from gateway.limits.rules import BudgetRule, surface_field
from gateway.limits.store import HELD, SPEND
from gateway.limits.windows import Window

_COUNTS = ("n", "hits", "in", "cached", "out")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished request: its surface, model, upstream tokens and cost (pUSD)."""

    surface: str
    model: str
    usage: Usage
    cost: int
    cache_hit: bool = False  # served by the gateway's cache: no upstream tokens, no cost

    def fields(self) -> tuple[tuple[str, int], ...]:
        """What to add (zeros left out: every field costs the settlement three arguments)."""
        u = self.usage
        n, hits, tokens_in, cached, out, cost = _field_names(self.surface)
        fields = (
            (SPEND, self.cost),
            (hits, 1 if self.cache_hit else 0),
            (tokens_in, u.input),
            (cached, u.cached_input),
            (out, u.output),
            (cost, self.cost),
        )
        return ((n, 1), *((k, v) for k, v in fields if v))


@functools.lru_cache(maxsize=1024)  # surfaces come from the policy: few, named per request
def _field_names(surface: str) -> tuple[str, ...]:
    return tuple(surface_field(surface, what) for what in (*_COUNTS, "cost$"))


@dataclass(frozen=True, slots=True)
class BudgetAlert:
    tenant: str
    window: Window
    fraction: Decimal
    spend: int  # pUSD after the crossing addition
    cap: int


def crossed(budget: BudgetRule, before: int, after: int) -> list[Decimal]:
    """The alert fractions crossed by going from ``before`` to ``after`` pUSD of spend."""
    return [f for f in budget.alert_at if before < f * budget.cap <= after]


def report(
    tenant: str,
    window: Window,
    fields: dict[str, int],
    budget: BudgetRule | None,
    surfaces: list[str],
) -> dict[str, Any]:
    """The usage report of one tenant and window (``GET /admin/usage``), exact decimals."""
    spend = fields.get(SPEND, 0)
    out: dict[str, Any] = {
        "tenant": tenant,
        "window": window.kind,
        "window_id": window.id,
        "window_start": window.start.isoformat(),
        "window_end": window.end.isoformat(),
        "spend_usd": usd_text(spend),
        "budget_usd": None,
        "remaining_usd": None,
        "held_usd": None,
    }
    if budget is not None and budget.window == window.kind:
        out["budget_usd"] = usd_text(budget.cap)
        out["remaining_usd"] = usd_text(max(0, budget.cap - spend))
        # what requests in flight hold of the remainder (their worst case, until they settle)
        out["held_usd"] = usd_text(fields.get(HELD, 0))
    rows: dict[str, Any] = {}
    totals = dict.fromkeys(_COUNTS, 0)
    for surface in surfaces:
        counts = {c: fields.get(surface_field(surface, c), 0) for c in _COUNTS}
        cost = fields.get(surface_field(surface, "cost$"), 0)
        if not counts["n"]:
            continue
        for c in _COUNTS:
            totals[c] += counts[c]
        rows[surface] = {
            "requests": counts["n"],
            "cache_hits": counts["hits"],
            "tokens": {
                "input": counts["in"],
                "cached_input": counts["cached"],
                "output": counts["out"],
            },
            "cost_usd": usd_text(cost),
            "cost_per_1k_requests_usd": usd_text(cost * 1000 // counts["n"]),
        }
    out["requests"] = totals["n"]
    out["cache_hits"] = totals["hits"]
    out["tokens"] = {
        "input": totals["in"],
        "cached_input": totals["cached"],
        "output": totals["out"],
    }
    out["surfaces"] = rows
    return out
