"""One admission check in the store's terms, and its answer in the client's.

A check asks the store for what a subject's rules take of one request (``takes``: a token
bucket per requests and tokens per minute, a concurrency slot, the tenant's own and on its
surface, each labelled with its kind and scope). The store's answer is read back here: the
tighter bucket of each kind becomes the ``x-ratelimit-*`` numbers (``rate_view``), and a
refusal becomes ``LimitExceeded``: which limit refused, why in words (naming the tenant, the
surface, the limit, and for a budget what was spent, what is held and what the request may
cost), and when to retry (``Retry-After``; none when the request could never fit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gateway.limits import gcra
from gateway.limits.cost import usd_text
from gateway.limits.headers import RateView, rate_headers, retry_headers
from gateway.limits.rules import Keys, RateLimits, Subject
from gateway.limits.store import (
    AcquireRequest,
    AcquireResult,
    BucketTake,
    BudgetGate,
    SlotTake,
)
from gateway.limits.windows import window_of

Reason = Literal["requests", "tokens", "concurrency", "budget", "unavailable"]
Label = tuple[Literal["requests", "tokens"], bool]  # a bucket's kind, and whether per surface
_ADJECTIVE = {"day": "daily", "week": "weekly", "month": "monthly"}


class LimitExceeded(Exception):
    def __init__(self, reason: Reason, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.headers = headers


def takes(
    keys: Keys, subject: Subject, tokens: int
) -> tuple[list[BucketTake], list[SlotTake], list[Label]]:
    buckets: list[BucketTake] = []
    kinds: list[Label] = []
    slots: list[SlotTake] = []
    scopes: list[tuple[str, RateLimits | None, bool]] = [
        (keys.scope(subject.tenant), subject.limits, False),
        (keys.scope(subject.tenant, subject.surface), subject.surface_limits, True),
    ]
    for scope, limits, on_surface in scopes:
        if limits is None or not limits:
            continue
        if limits.requests_per_minute is not None:
            buckets.append(BucketTake(scope + ":r", gcra.Rate(limits.requests_per_minute), 1))
            kinds.append(("requests", on_surface))
        if limits.tokens_per_minute is not None:
            rate = gcra.Rate(limits.tokens_per_minute)
            buckets.append(BucketTake(scope + ":k", rate, max(0, tokens)))
            kinds.append(("tokens", on_surface))
        if limits.max_concurrent is not None:
            slots.append(SlotTake(scope + ":c", limits.max_concurrent))
    return buckets, slots, kinds


def rate_view(
    req: AcquireRequest, result: AcquireResult, kinds: list[Label], kind: str
) -> RateView | None:
    """The tighter of the buckets of ``kind`` (tenant, surface): the fewer remaining."""
    best: RateView | None = None
    for take, debt, (k, _) in zip(req.buckets, result.debts, kinds, strict=True):
        if k != kind:
            continue
        view = RateView(
            take.rate.limit, gcra.remaining(debt, take.rate), gcra.reset_ms(debt, take.rate)
        )
        if best is None or (view.remaining, view.limit) < (best.remaining, best.limit):
            best = view
    return best


def refusal(
    subject: Subject,
    req: AcquireRequest,
    result: AcquireResult,
    kinds: list[Label],
    requests: RateView | None,
    tokens: RateView | None,
    now_s: Callable[[], float],
) -> LimitExceeded:
    headers = rate_headers(requests, tokens)
    tenant = subject.tenant
    if result.blocked_by == "budget":
        assert req.budget is not None
        message, wait = _budget_refusal(subject, req.budget, result, now_s)
        return LimitExceeded("budget", message, {**headers, **retry_headers(wait)})
    if result.blocked_by == "slot":
        limit = req.slots[result.blocked_index].limit
        return LimitExceeded(
            "concurrency",
            f"tenant {tenant!r} has {limit} requests in flight, its max_concurrent",
            {**headers, **retry_headers(1000)},
        )
    take = req.buckets[result.blocked_index]
    kind, on_surface = kinds[result.blocked_index]
    where = f" on surface {subject.surface!r}" if on_surface else ""
    if result.wait_ms is None:
        message = (
            f"request too large: {take.amount} tokens (prompt estimate plus max_tokens) "
            f"exceed the limit of {take.rate.limit} tokens per minute{where}"
        )
    else:
        message = (
            f"rate limit reached for tenant {tenant!r}{where}: limit "
            f"{take.rate.limit} {kind} per minute, requested {take.amount}"
        )
    return LimitExceeded(
        kind,
        message,
        {**headers, **retry_headers(result.wait_ms)},
    )


def _budget_refusal(
    subject: Subject, gate: BudgetGate, result: AcquireResult, now_s: Callable[[], float]
) -> tuple[str, int | None]:
    """Why the budget cannot cover the request, and when to retry (None: never)."""
    assert subject.budget is not None
    now = now_s()
    window = window_of(subject.budget.window, now)
    budget = f"{_ADJECTIVE[window.kind]} budget of {subject.budget.usd} USD"
    renews = int(window.seconds_left(now) * 1000)
    tenant, spend = subject.tenant, result.spend
    cost = gate.hold.amount if gate.hold is not None else 0
    worst = (
        f"this request may cost up to {usd_text(cost)} USD (its prompt estimate plus "
        "max_tokens, or the expected output without it, at its costliest model's price)"
    )
    if spend >= gate.cap:
        why = f"tenant {tenant!r} has spent its {budget}; it renews at {window.end.isoformat()}"
        return why, renews
    if cost > gate.cap:
        return f"request too costly for tenant {tenant!r}'s {budget}: {worst}", None
    left = usd_text(gate.cap - spend)
    if spend + cost > gate.cap:
        return (
            f"tenant {tenant!r} has {left} USD left of its {budget} and {worst}; "
            f"it renews at {window.end.isoformat()}",
            renews,
        )
    return (
        f"requests in flight hold {usd_text(result.budget_held)} USD of the {left} USD left "
        f"of tenant {tenant!r}'s {budget} and {worst}",
        1000,
    )
