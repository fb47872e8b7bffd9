"""Anthropic's Messages API as a backend (``kind: anthropic``).

Chat requests go to ``POST {base_url}/messages`` with ``x-api-key`` and ``anthropic-version``;
``anthropic_request`` translates them, ``anthropic_response`` and ``anthropic_stream`` translate
the answers back. A client of the Messages API itself (``Endpoint.MESSAGES``) is relayed
untranslated: its body with only the model renamed, the answer as Anthropic sent it. Bodies are
asked for uncompressed: the gateway reads them. A 200 to a stream request that is not SSE is
left as it came: a whole JSON message is translated whole (the relay sends it as a stream), and
anything else is refused by the attempt's check of streams (``bad_answer``: retried elsewhere).
"""

from __future__ import annotations

import json
from functools import partial

import aiohttp

from gateway.errors import BadRequest
from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.upstream.client import UpstreamResponse
from gateway.upstream.providers.anthropic_options import format_tool_name
from gateway.upstream.providers.anthropic_request import to_messages_request
from gateway.upstream.providers.anthropic_response import translate_body
from gateway.upstream.providers.anthropic_stream import AnthropicStream
from gateway.upstream.providers.translated import TranslatedResponse

ANTHROPIC_VERSION = "2023-06-01"


class AnthropicProvider:
    path = "messages"

    def __init__(self, backend: str, api_key: str | None, default_max_tokens: int) -> None:
        self.backend = backend
        self.default_max_tokens = default_max_tokens
        self.headers = {"anthropic-version": ANTHROPIC_VERSION, "Accept-Encoding": "identity"}
        if api_key:
            self.headers["x-api-key"] = api_key

    def body(self, parsed: ParsedRequest, upstream_model: str, max_tokens_cap: int | None) -> bytes:
        if parsed.endpoint is Endpoint.MESSAGES:
            return parsed.body_for(upstream_model)
        if parsed.endpoint is not Endpoint.CHAT:
            raise BadRequest(
                f"model '{parsed.model}' is served by the Anthropic backend '{self.backend}', "
                f"which answers chat, Responses and Messages requests, not /v1/{parsed.endpoint.value}",
                param="model",
            )
        request = to_messages_request(
            parsed.body, upstream_model, self.default_max_tokens, max_tokens_cap
        )
        return json.dumps(request).encode()

    def wrap(self, response: aiohttp.ClientResponse, parsed: ParsedRequest) -> UpstreamResponse:
        if parsed.endpoint is Endpoint.MESSAGES:
            return response  # already in the client's API
        stream = None
        tool = format_tool_name(parsed.body)
        if parsed.stream and response.status == 200:
            ctype = response.headers.get("Content-Type", "text/event-stream").lower()
            if "event-stream" in ctype:
                opts = parsed.body.get("stream_options")
                include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                stream = AnthropicStream(include_usage, parsed.model, tool)
            elif "json" not in ctype:
                return response  # no stream, no answer (a proxy's page): refused as bad_answer
            # else a whole message (a server that ignored ``stream``): translated whole
        return TranslatedResponse(response, partial(translate_body, format_tool=tool), stream)
