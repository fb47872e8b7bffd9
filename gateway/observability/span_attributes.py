"""Span attribute vocabulary: the names a span's attributes carry and the mappings made of them.

Names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*`` and ``server.*``, as the
registry spells them); the gateway's own are ``gateway.*``. Every string that comes from a caller
or an upstream is cut to a bound here (``capped``, ``capped_content``), whatever it was sent. An
attempt's attributes and an upstream's server attributes are made once per distinct value and
shared, never mutated (``span_records.CONSTANT`` groups, whose encoding the encoder caches by identity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

# GenAI semantic conventions (attribute names as the OpenTelemetry registry spells them).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
# The upstream's id of an answer its client got with another (re-told in the client's API).
UPSTREAM_RESPONSE_ID = "gateway.upstream.response_id"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
REQUEST_ID = "gateway.request.id"
# The request parameters a span records (the body's field: its attribute); never the prompt.
REQUEST_PARAMS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
    "stream": "gen_ai.request.stream",
}
# A caller's (or an upstream's) string in a span is cut to this many characters: a span is a
# few hundred bytes, and a 4 MB model name must not become a 4 MB span (which the encoder would
# keep in its caches and a collector would refuse with the whole batch).
MAX_TEXT = 256
# Recorded prompt and completion text (``record_content``) is cut to this many characters per
# attribute, ending with a marker that says how much was left out (the value is then no longer
# valid JSON): a 1 MB prompt must not be queued whole while the collector is slow, nor make a
# batch that the collector refuses (its default limit: 20 MiB a request).
MAX_CONTENT_CHARS = 8192


def response_attributes(
    model: str | None,
    response_id: str | None,
    input_tokens: int | None,
    output_tokens: int | None,
    finish_reasons: Sequence[str],
    client_id: str | None = None,
) -> dict[str, Any]:
    """``gen_ai.response.id`` is the id the client got: ``client_id`` when it is not the
    upstream's (then ``UPSTREAM_RESPONSE_ID``)."""
    upstream_id = None if response_id is None else capped(response_id)
    return {
        RESPONSE_MODEL: None if model is None else capped(model),
        RESPONSE_ID: upstream_id if client_id is None else client_id,
        UPSTREAM_RESPONSE_ID: None if client_id is None else upstream_id,
        INPUT_TOKENS: input_tokens,
        OUTPUT_TOKENS: output_tokens,
        FINISH_REASONS: list(finish_reasons) or None,
    }


def capped(text: str) -> str:
    """``text`` cut to ``MAX_TEXT`` characters (a caller's model name, an upstream's id)."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT]


def capped_content(text: str | None) -> str | None:
    """Recorded content cut to ``MAX_CONTENT_CHARS``, with a marker saying what was cut."""
    if text is None or len(text) <= MAX_CONTENT_CHARS:
        return text
    return f"{text[:MAX_CONTENT_CHARS]}...[truncated: {len(text)} characters in all]"


@lru_cache(maxsize=1024)
def attempt_attributes(
    operation: str,
    base_url: str,
    upstream_model: str,
    backend: str,
    replica: str,
    hedge: bool,
    index: int,
    provider: str | None,
) -> Mapping[str, Any]:
    """An attempt's attributes (one shared, never mutated mapping per distinct attempt)."""
    return {
        OPERATION: operation,
        REQUEST_MODEL: upstream_model,
        **server_attributes(base_url),
        "gateway.backend": backend,
        "gateway.replica": replica,
        "gateway.attempt.hedge": hedge,
        "gateway.attempt.index": index,
        PROVIDER: provider,
    }


@lru_cache(maxsize=256)
def server_attributes(url: str) -> Mapping[str, Any]:
    """``server.address`` and ``server.port`` of an upstream URL (parsed once per URL)."""
    parts = urlsplit(url)
    return {SERVER_ADDRESS: parts.hostname or url, SERVER_PORT: parts.port}
