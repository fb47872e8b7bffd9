"""The cost of a response, exactly, from a model's price per million tokens.

Money is counted in integer pico-dollars (1 USD = 10**12 pUSD). A price is given per million
tokens with at most six decimals (``0.075`` USD/Mtok), so one token costs a whole number of
pUSD (``price * 10**6``) and a response's cost is a sum of integer products: no rounding
happens anywhere, in one gateway or summed across many. Prices are read from their decimal
text (a YAML ``0.15`` is the decimal 0.15, never the binary float nearest to it).

Usage follows OpenAI: ``input`` counts every input token, cached ones included, and
``cached_input`` how many of them were read from the provider's prompt cache (``Usage.read``
maps the Responses and Anthropic shapes onto it). Those are priced at ``cached_input_per_mtok`` (the input price when it is not
given), the rest at ``input_per_mtok``, and ``completion_tokens`` at ``output_per_mtok``.

An answer's token counts are believed up to ``MAX_TOKENS`` each (10**9, a thousand times the
largest context windows): a count beyond it (an upstream's bug) makes the usage malformed, so
the request is charged its estimate. Unbounded, one such answer would overflow the Prometheus
counters (doubles) and leave the range where the Redis scripts' arithmetic is exact (2**53).
A usage that leaves a count out is incomplete, charged its estimate too (``Usage.read``): a
missing output read as 0 would let an answer go uncharged.

Rounding happens only where a figure leaves the gateway as a float: Prometheus counters (USD
as a double, about 16 significant digits). Headers and the usage report print exact decimals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeGuard

PICO_PER_USD = 10**12
MAX_TOKENS = 10**9  # the most one answer's usage may report per count (module comment)
_PICO_PER_TOKEN_PER_MTOK = 10**6  # 1 USD per Mtok = 1e-6 USD per token = 1e6 pUSD per token


def pico_per_token(usd_per_mtok: Decimal | str | int) -> int:
    """The price of one token in pUSD; at most six decimals, else a ValueError."""
    value = Decimal(str(usd_per_mtok)) * _PICO_PER_TOKEN_PER_MTOK
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"a price per Mtok must be >= 0 with at most 6 decimals: {usd_per_mtok}")
    return int(value)


def usd_to_pico(usd: Decimal | str | int) -> int:
    value = Decimal(str(usd)) * PICO_PER_USD
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"an amount of USD must be >= 0 with at most 12 decimals: {usd}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Price:
    """pUSD per token: input (not cached), cached input, output."""

    input: int
    cached_input: int
    output: int

    @classmethod
    def per_mtok(
        cls,
        input_per_mtok: Decimal | str | int,
        output_per_mtok: Decimal | str | int,
        cached_input_per_mtok: Decimal | str | int | None = None,
    ) -> Price:
        cached = input_per_mtok if cached_input_per_mtok is None else cached_input_per_mtok
        return cls(
            pico_per_token(input_per_mtok), pico_per_token(cached), pico_per_token(output_per_mtok)
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one response: ``input`` includes ``cached_input`` (OpenAI's convention)."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output

    @classmethod
    def read(cls, usage: Any) -> Usage | None:
        """An answer's ``usage`` in any API the gateway relays; None when missing, malformed or
        incomplete (the request is then charged its estimate).

        * Chat completions: ``prompt_tokens`` (cached included), ``prompt_tokens_details.
          cached_tokens``, ``completion_tokens``;
        * the Responses API: ``input_tokens`` (cached included), ``input_tokens_details.
          cached_tokens``, ``output_tokens`` (it also has ``total_tokens``);
        * Anthropic's Messages API: ``input_tokens`` *without* the cache, ``cache_read_input_
          tokens`` and ``cache_creation_input_tokens`` beside it, ``output_tokens``. Cache writes
          are priced as input here (Anthropic bills them at 1.25x).

        A usage without its output count has it as ``total_tokens`` minus the input when it
        tells both (an embedding's usage: 0); else it is incomplete, as one without its input
        count is: a missing count is not a zero.
        """
        if not isinstance(usage, Mapping):
            return None
        if "prompt_tokens" in usage:
            prompt, details = usage.get("prompt_tokens"), "prompt_tokens_details"
        elif "input_tokens_details" in usage or "total_tokens" in usage:
            prompt, details = usage.get("input_tokens"), "input_tokens_details"
        else:
            return cls._of_anthropic(usage)
        output = _output(usage, prompt)
        if output is None or not believed_count(prompt):
            return None
        told = usage.get(details)
        cached = told.get("cached_tokens") if isinstance(told, Mapping) else None
        cached = min(cached, prompt) if believed_count(cached) else 0
        return cls(input=prompt, cached_input=cached, output=output)

    @classmethod
    def _of_anthropic(cls, usage: Mapping[str, Any]) -> Usage | None:
        fresh, output = usage.get("input_tokens"), usage.get("output_tokens")
        read = usage.get("cache_read_input_tokens") or 0  # optional: null is none read
        written = usage.get("cache_creation_input_tokens") or 0
        if not (
            believed_count(fresh)
            and believed_count(output)
            and believed_count(read)
            and believed_count(written)
        ):
            return None
        return cls(input=fresh + read + written, cached_input=read, output=output)


def _output(usage: Mapping[str, Any], prompt: Any) -> int | None:
    """The output count of an OpenAI-shaped usage (``Usage.read``); None when unreadable."""
    for key in ("completion_tokens", "output_tokens"):
        if key in usage:
            told = usage[key]
            return told if believed_count(told) else None
    total = usage.get("total_tokens")
    if believed_count(total) and believed_count(prompt) and total >= prompt:
        return total - prompt
    return None


def believed_count(value: Any) -> TypeGuard[int]:
    """A token count an answer may report: an int in 0..``MAX_TOKENS`` (module comment); also
    what a span shows."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def cost_pico(price: Price, usage: Usage) -> int:
    uncached = usage.input - usage.cached_input
    return (
        uncached * price.input
        + usage.cached_input * price.cached_input
        + usage.output * price.output
    )


def most_cost(price: Price, input_tokens: int, output_tokens: int) -> int:
    """The most an answer of these token counts may cost: every input token at the dearer of
    the cached and the uncached price (what a budget holds while the answer runs)."""
    return input_tokens * max(price.input, price.cached_input) + output_tokens * price.output


def usd_text(pico: int) -> str:
    """Exact decimal USD: ``4350000`` pUSD -> ``"0.00000435"``; zero -> ``"0"``."""
    text = format(Decimal(pico).scaleb(-12), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def usd_float(pico: int) -> float:
    """For Prometheus only (a double): the one place a cost is rounded."""
    return pico / PICO_PER_USD
