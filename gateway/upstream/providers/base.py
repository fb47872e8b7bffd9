"""The interface of a backend that speaks another API than OpenAI's.

The gateway speaks OpenAI's wire format everywhere (relay, cache capture, cascade, span
summaries); a provider translates at the upstream boundary only, once per attempt: the request
on its way out (``body``, ``path``, ``headers``) and the answer on its way back (``wrap``). A
backend without a provider (vLLM, OpenAI-compatible) is sent the client's bytes untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import aiohttp

from gateway.protocol.openai import ParsedRequest
from gateway.upstream.client import UpstreamResponse


class Provider(Protocol):
    @property
    def path(self) -> str:
        """Where requests go, under the backend's base URL."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Sent with every request (the key, the API version), in place of a bearer token."""
        ...

    def body(self, parsed: ParsedRequest, upstream_model: str, max_tokens_cap: int | None) -> bytes:
        """The upstream request; raises ``BadRequest`` for what the API cannot honour."""
        ...

    def wrap(self, response: aiohttp.ClientResponse, parsed: ParsedRequest) -> UpstreamResponse:
        """The upstream's answer, read as OpenAI's."""
        ...
