"""One request in a client dialect: the request the pipeline runs, and how its answer goes back.

A call gives the orchestrator a ``ParsedRequest`` (the translated chat request, or the client's
own bytes for a passthrough) and takes the answer back: ``render`` for a whole body (an answer
or an error), ``stream`` for the encoder the relay writes through. A Responses call also keeps
the conversation: ``ended`` stores the finished response (before the client reads its end,
so a follow-up with ``previous_response_id`` always finds it); for a passthrough, whose upstream
keeps the response, it stores only the record that the response is this tenant's. The relay
drives both through ``gateway.upstream.out.ClientDialect``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.conversations import RecordTooLarge, ResponseStore, StoredResponse, StoreUnavailable
from gateway.errors import error_bytes
from gateway.observability.log_every import LogEvery
from gateway.protocol import anthropic_messages_output as messages_out
from gateway.protocol import upstream_json
from gateway.protocol.anthropic_messages import MessagesRequest
from gateway.protocol.anthropic_messages_stream import MessagesStream
from gateway.protocol.chat_events import UNREADABLE
from gateway.protocol.openai import Endpoint, ParsedRequest, user_text
from gateway.protocol.relayed import (
    MESSAGES_END,
    RESPONSES_END,
    RelayedStream,
    answer_ids,
    messages_error,
    responses_error,
)
from gateway.protocol.responses import (
    ResponsesRequest,
    carries_thinking,
    input_messages,
    new_id,
)
from gateway.protocol.responses_output import from_chat_completion
from gateway.protocol.responses_params import callers_error
from gateway.protocol.responses_stream import ResponsesStream
from gateway.upstream.out import ClientStream

log = logging.getLogger("llm_gateway.dialects")
_unreadable = LogEvery(log)  # an upstream that sends one such answer sends them all
_UNREADABLE_ANSWER = "the upstream's answer could not be read"
MAX_OWNED = 16  # ids of objects one relayed response made that are recorded as the tenant's


def _retold(body: bytes, translate: Callable[[Any], dict[str, Any]]) -> dict[str, Any] | None:
    """A whole chat answer in the client's API; None when it cannot be read (not JSON, or of a
    shape the translator cannot take: logged by the error's type, never the answer)."""
    try:
        return translate(upstream_json.loads(body))
    except UNREADABLE as exc:
        kind = type(exc).__name__
        _unreadable.warning(kind, "an upstream answer could not be re-told (%s)", kind)
        return None


def chat_request(
    chat: dict[str, Any], model: str, stream: bool, continues: bool = False, thinking: bool = False
) -> ParsedRequest:
    """The translated request, with the user's text by the chat endpoint's own rule: the
    semantic cache matches it and the difficulty estimator scores it, as for a chat request
    (without it a Messages or Responses question was only ever an exact hit)."""
    text = user_text(Endpoint.CHAT, chat)
    raw = json.dumps(chat).encode()
    return ParsedRequest(Endpoint.CHAT, raw, chat, model, stream, text, continues, thinking)


@dataclass(slots=True)
class ResponsesCall:
    request: ResponsesRequest
    tenant: str
    store: ResponseStore | None
    history: list[dict[str, Any]] = field(default_factory=list)
    passthrough: ParsedRequest | None = None  # the client's request, for `responses: passthrough`
    response_id: str = field(default_factory=lambda: new_id("resp"))
    final: dict[str, Any] | None = None  # the Response object, once it is known
    relayed_id: str | None = None  # a passthrough's: the id of the response kept upstream
    owned: tuple[str, ...] = ()  # a passthrough's: what else it made upstream (``owned_ids``)
    _stream: ResponsesStream | None = None
    _relayed: RelayedStream | None = None
    parsed: ParsedRequest = field(init=False)  # what the stages run: translated once, here

    def __post_init__(self) -> None:
        if self.passthrough is not None:
            self.parsed = self.passthrough
        else:
            chat = self.request.chat_body(self.history)
            thinking = carries_thinking(chat["messages"])
            self.parsed = chat_request(
                chat, self.request.model, self.request.stream, False, thinking
            )

    @property
    def answer_id(self) -> str | None:
        return None if self.passthrough is not None else self.response_id

    def render(self, status: int, body: bytes) -> tuple[int, bytes]:
        if status == 200 and self.passthrough is not None:
            self.relayed_id, self.owned = answer_ids(body)
        if self.passthrough is not None:
            return status, body
        if status != 200:  # OpenAI's shape in both APIs, told in the caller's parameters
            return status, callers_error(body)
        self.final = _retold(
            body, lambda a: from_chat_completion(a, self.request, self.response_id)
        )
        if self.final is None:
            return 502, error_bytes(_UNREADABLE_ANSWER, "upstream_error", "bad_gateway")
        return status, json.dumps(self.final).encode()

    def stream(self) -> ClientStream:
        if self.passthrough is not None:
            self._relayed = RelayedStream(RESPONSES_END, responses_error, ids=True)
            return self._relayed
        self._stream = ResponsesStream(self.request, self.response_id)
        return self._stream

    async def ended(self) -> None:
        """Store the finished response (``store`` true), or for a passthrough the record that
        the upstream's response is this tenant's (the only way a ``previous_response_id``
        naming it is relayed); a failure to store is logged only: the answer was served, and a
        follow-up naming it gets a clear 404 (400 ``previous_response_not_found``)."""
        if self._stream is not None and self._stream.done and not self._stream.failed:
            self.final = self._stream.response
        if self._relayed is not None:
            self.relayed_id, self.owned = self._relayed.response_id, self._relayed.owned
        if not self.request.store or self.store is None:
            return
        if self.passthrough is not None:
            if self.relayed_id is not None:  # with it, the reasoning items and containers it made
                owned = self.owned[:MAX_OWNED]
                await asyncio.gather(
                    *(self._put(StoredResponse.ownership(self.tenant, n)) for n in owned)
                )
                # Last: the store evicts the first written, never the response just returned.
                await self._put(StoredResponse.ownership(self.tenant, self.relayed_id))
            return
        final = self.final
        if final is None:
            return
        # Reasoning is kept only as the signed thinking an Anthropic backend needs back.
        messages = [*self.history, *self.request.messages, *input_messages(final["output"])]
        await self._put(StoredResponse(final, self.request.items, messages, self.tenant))

    async def _put(self, record: StoredResponse) -> None:
        assert self.store is not None
        try:
            await self.store.put(record)
        except RecordTooLarge as exc:
            log.warning("response %s not stored: the conversation is too long (%s)", record.id, exc)
        except StoreUnavailable as exc:
            log.warning("response %s not stored: %s", record.id, exc)


@dataclass(slots=True)
class MessagesCall:
    request: MessagesRequest
    passthrough: ParsedRequest | None = None  # the client's request, for a kind: anthropic backend
    message_id: str = field(default_factory=messages_out.new_message_id)  # of a re-told answer
    parsed: ParsedRequest = field(init=False)  # what the stages run: translated once, here

    def __post_init__(self) -> None:
        request = self.request
        self.parsed = self.passthrough or chat_request(
            request.chat, request.model, request.stream, request.prefill
        )

    @property
    def answer_id(self) -> str | None:
        return None if self.passthrough is not None else self.message_id

    def render(self, status: int, body: bytes) -> tuple[int, bytes]:
        if self.passthrough is not None:
            return status, body  # Anthropic's own answer or error
        if status != 200:
            return messages_out.from_openai_error(status, body)
        request, message_id = self.request, self.message_id
        message = _retold(
            body,
            lambda a: messages_out.from_chat_completion(
                a, request.model, request.stop_sequences, message_id
            ),
        )
        if message is None:
            return 502, json.dumps(messages_out.error_body(502, _UNREADABLE_ANSWER)).encode()
        return status, json.dumps(message).encode()

    def stream(self) -> ClientStream:
        if self.passthrough is not None:
            return RelayedStream(MESSAGES_END, messages_error)
        return MessagesStream(self.request.model, self.request.stop_sequences, self.message_id)

    async def ended(self) -> None:
        return None
