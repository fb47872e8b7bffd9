"""Output discipline: lower ``max_tokens`` so the whole answer fits the total budget.

With the first token expected after ``ttft_ms`` and each further token ``itl_ms`` apart, an
answer of ``n`` tokens ends at ``elapsed + ttft + (n - 1) x itl``; the largest ``n`` that ends
by ``total_ms`` is ``1 + floor((total - elapsed - ttft) / itl)``, never below ``min_tokens``.
The client's own smaller ``max_tokens`` is left alone.
"""

from __future__ import annotations

import math
from typing import Any

_FIELDS = ("max_completion_tokens", "max_tokens")


def cap_max_tokens(
    *,
    total_ms: float,
    elapsed_ms: float,
    ttft_ms: float,
    itl_ms: float | None,
    requested: int | None,
    min_tokens: int = 1,
) -> int | None:
    """The ``max_tokens`` to send, or None to leave the request unchanged."""
    if itl_ms is None or itl_ms <= 0:
        return None  # no observed decode speed yet: nothing to compute a cap from
    room = total_ms - elapsed_ms - ttft_ms
    fit = 1 + math.floor(room / itl_ms) if room >= 0 else 0
    cap = max(fit, min_tokens)
    if requested is not None and requested <= cap:
        return None
    return cap


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    for name in _FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def with_max_tokens(body: dict[str, Any], cap: int) -> dict[str, Any]:
    """A copy of ``body`` asking for at most ``cap`` tokens (in the field the client used)."""
    out = dict(body)
    present = [name for name in _FIELDS if name in body]
    for name in present or ["max_tokens"]:
        out[name] = cap
    return out
