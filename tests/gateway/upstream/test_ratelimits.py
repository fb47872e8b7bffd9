"""Providers' rate limit headers: parsed as OpenAI and Anthropic write them, and the pacing."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from gateway.upstream.ratelimits import ProviderLimits, UpstreamLimits, duration_s, retry_after_s


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1.5s", 1.5), ("1h2m3s", 3723.0), ("7", 7.0)],
)
def test_openai_durations(text: str, seconds: float) -> None:
    assert duration_s(text) == pytest.approx(seconds)


def test_not_durations() -> None:
    assert duration_s("soon") is None and duration_s("5x") is None


def test_retry_after_in_every_form() -> None:
    assert retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after_s({"retry-after": "3"}) == 3.0
    at = datetime.now(UTC) + timedelta(seconds=30)
    assert 28 <= (retry_after_s({"retry-after": format_datetime(at, usegmt=True)}) or 0) <= 31
    assert retry_after_s({}) is None


def test_openai_headers_pace_until_the_reset() -> None:
    limits = ProviderLimits()
    limits.observe({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s",
                    "x-ratelimit-remaining-tokens": "5000", "x-ratelimit-reset-tokens": "6m0s"},
                   200, now=100.0)  # fmt: skip
    assert limits.wait_s(tokens=10, now=100.5) == pytest.approx(1.5)
    assert limits.wait_s(tokens=10, now=103.0) == 0.0  # past the reset: no wait
    assert limits.wait_s(tokens=6000, now=103.0) == pytest.approx(357.0)  # not enough tokens


def test_anthropic_headers_and_a_429() -> None:
    reset = (datetime.now(UTC) + timedelta(seconds=10)).isoformat().replace("+00:00", "Z")
    limits = ProviderLimits()
    now = time.monotonic()
    limits.observe({"anthropic-ratelimit-tokens-remaining": "0",
                    "anthropic-ratelimit-tokens-reset": reset}, 200, now)  # fmt: skip
    assert 9 <= limits.wait_s(1, now) <= 10.5
    fresh = ProviderLimits()
    fresh.observe({"retry-after": "4"}, 429, now)
    assert fresh.wait_s(1, now) == pytest.approx(4.0)


def test_replicas_that_never_said_anything_are_not_tracked() -> None:
    table = UpstreamLimits()
    table.observe("http://a/v1", {"content-type": "application/json"}, 200)
    assert table.wait_s("http://a/v1", lambda: pytest.fail("no estimate needed")) == 0.0
    table.observe("http://b/v1", {"retry-after": "2"}, 429)
    assert 1.9 <= table.wait_s("http://b/v1", lambda: 1) <= 2.0
