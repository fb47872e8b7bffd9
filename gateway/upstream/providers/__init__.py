"""Backends that speak another API than OpenAI's, translated at the upstream boundary."""

from __future__ import annotations

import os

from gateway.upstream.providers.anthropic import AnthropicProvider
from gateway.upstream.providers.base import Provider
from policies.backends import AnthropicBackend, Backend

__all__ = ["Provider", "build_provider"]


def build_provider(name: str, backend: Backend) -> Provider | None:
    """The provider for ``backend``; None for backends that speak OpenAI's API themselves."""
    if isinstance(backend, AnthropicBackend):
        key = os.environ.get(backend.api_key_env) if backend.api_key_env else None
        return AnthropicProvider(name, key, backend.default_max_tokens)
    return None
