"""The ``x-ratelimit-*`` and ``Retry-After`` headers, as OpenAI sends them.

``x-ratelimit-limit-requests`` / ``-tokens``: the limit per minute; ``remaining``: what could
be taken now; ``reset``: the time until the limit is back to full, as OpenAI writes durations
(``"20ms"``, ``"1.5s"``, ``"6m0s"``). When a tenant has a limit of its own and one on the
surface, the headers describe the tighter one (the fewer remaining). ``Retry-After`` is whole
seconds, rounded up; ``retry-after-ms`` (which the openai client reads first) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RateView:
    limit: int
    remaining: int
    reset_ms: int


def duration(ms: int) -> str:
    """OpenAI's style: ``0s``, ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        seconds = ms / 1000
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    total_s = -(-ms // 1000)
    hours, rest = divmod(total_s, 3600)
    minutes, seconds_i = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{seconds_i}s"


def rate_headers(requests: RateView | None, tokens: RateView | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, view in (("requests", requests), ("tokens", tokens)):
        if view is not None:
            out[f"x-ratelimit-limit-{name}"] = str(view.limit)
            out[f"x-ratelimit-remaining-{name}"] = str(view.remaining)
            out[f"x-ratelimit-reset-{name}"] = duration(view.reset_ms)
    return out


def retry_headers(wait_ms: int | None) -> dict[str, str]:
    if wait_ms is None:
        return {}
    wait_ms = max(wait_ms, 0)
    return {"Retry-After": str(max(1, -(-wait_ms // 1000))), "retry-after-ms": str(wait_ms)}
