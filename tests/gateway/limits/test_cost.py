"""Cost: exact pUSD from prices per Mtok, cached input apart, exact decimal text."""

from __future__ import annotations

from decimal import Decimal

import pytest

from gateway.limits.cost import (
    MAX_TOKENS,
    Price,
    Usage,
    cost_pico,
    pico_per_token,
    usd_float,
    usd_text,
    usd_to_pico,
)

PRICE = Price.per_mtok("0.15", "0.60", "0.075")


def test_prices_per_token_are_whole_pico_dollars() -> None:
    assert Price(input=150_000, cached_input=75_000, output=600_000) == PRICE
    assert pico_per_token(Decimal("0.000001")) == 1
    # A YAML float's text is its decimal value: 0.1 is exactly 0.1, never 0.1000000000000000055.
    assert pico_per_token(str(0.1)) == 100_000
    with pytest.raises(ValueError, match="6 decimals"):
        pico_per_token("0.0000001")
    with pytest.raises(ValueError, match=">= 0"):
        pico_per_token("-1")


def test_cached_input_is_priced_apart() -> None:
    usage = Usage(input=1_000, cached_input=400, output=200)
    # 600 x 0.15 + 400 x 0.075 + 200 x 0.60, per million: 0.00009 + 0.00003 + 0.00012
    assert cost_pico(PRICE, usage) == 240_000_000
    assert usd_text(cost_pico(PRICE, usage)) == "0.00024"
    no_cache_price = Price.per_mtok("0.15", "0.60")
    assert cost_pico(no_cache_price, usage) == 270_000_000


def test_sums_stay_exact_where_floats_drift() -> None:
    one = cost_pico(Price.per_mtok("0.1", "0.2"), Usage(input=1, output=0))
    total = sum(one for _ in range(1_000_000))
    assert usd_text(total) == "0.1"
    assert sum(0.1 / 1e6 for _ in range(1_000_000)) != 0.1  # what a float sum would report


def test_usd_text_and_float() -> None:
    assert usd_text(0) == "0"
    assert usd_text(1) == "0.000000000001"
    assert usd_text(12_500_000_000_000) == "12.5"
    assert usd_text(10**12) == "1"
    assert usd_float(2_500_000_000) == pytest.approx(0.0025)
    assert usd_to_pico("50") == 50 * 10**12
    with pytest.raises(ValueError, match="12 decimals"):
        usd_to_pico("0.0000000000001")


def test_usage_of_chat_completions() -> None:
    assert Usage.read({"prompt_tokens": 10, "completion_tokens": 3}) == Usage(10, 0, 3)
    cached = {"prompt_tokens": 10, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    assert Usage.read(cached) == Usage(10, 8, 3)
    over = {"prompt_tokens": 10, "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 99}}  # fmt: skip
    assert Usage.read(over) == Usage(10, 10, 0)  # never more cached than the prompt
    embeddings = {"prompt_tokens": 5, "total_tokens": 5}
    assert Usage.read(embeddings) == Usage(5, 0, 0)  # the output: total minus prompt
    assert Usage.read({"prompt_tokens": 1000, "total_tokens": 1300}) == Usage(1000, 0, 300)
    bads: tuple[object, ...] = (None, [], {"completion_tokens": 3}, {"prompt_tokens": -1},
                {"prompt_tokens": True}, {"prompt_tokens": 1, "completion_tokens": "2"},
                {"prompt_tokens": 1, "completion_tokens": None},
                # incomplete: a missing count is not a zero (the estimate is charged)
                {"prompt_tokens": 5}, {"prompt_tokens": 5, "total_tokens": 4},
                {"prompt_tokens": 5, "total_tokens": "9"})  # fmt: skip
    for bad in bads:
        assert Usage.read(bad) is None


def test_usage_past_belief_is_malformed() -> None:
    """A count past MAX_TOKENS is an upstream's bug: the request is charged its estimate."""
    edge = {"prompt_tokens": MAX_TOKENS, "completion_tokens": MAX_TOKENS}
    assert Usage.read(edge) == Usage(MAX_TOKENS, 0, MAX_TOKENS)
    for field in ("prompt_tokens", "completion_tokens"):
        assert Usage.read({**edge, field: MAX_TOKENS + 1}) is None
        assert Usage.read({**edge, field: 10**400}) is None
    anthropic = {"input_tokens": 1, "cache_read_input_tokens": 2**64, "output_tokens": 1}
    assert Usage.read(anthropic) is None


def test_usage_of_the_responses_and_messages_apis() -> None:
    responses = {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 20},
                 "output_tokens": 7, "total_tokens": 37}  # fmt: skip
    assert Usage.read(responses) == Usage(30, 20, 7)
    # Anthropic counts cache reads and writes apart from input_tokens.
    anthropic = {"input_tokens": 11, "cache_read_input_tokens": 2,
                 "cache_creation_input_tokens": 3, "output_tokens": 7}  # fmt: skip
    assert Usage.read(anthropic) == Usage(16, 2, 7)
    incomplete: tuple[object, ...] = (
        {"output_tokens": 15},  # a message_delta's alone
        {"input_tokens": 15},
        {"input_tokens": -1, "output_tokens": 1},
        {"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": -5},
        {"input_tokens": 1, "output_tokens": None},
        {"input_tokens": 1, "output_tokens": 300.0},
        {"input_tokens": 1, "output_tokens": True},
    )
    for bad in incomplete:
        assert Usage.read(bad) is None
    null_cache = {"input_tokens": 1, "output_tokens": 2, "cache_read_input_tokens": None}
    assert Usage.read(null_cache) == Usage(1, 0, 2)  # optional counts may be null
    responses = {"input_tokens": 30, "total_tokens": 37}
    assert Usage.read(responses) == Usage(30, 0, 7)
