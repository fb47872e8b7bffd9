"""Stored Responses API responses: ``previous_response_id``, GET / DELETE and input items.

A stored response is one record, scoped to its tenant: the Response object, this request's
input items (what ``GET /v1/responses/{id}/input_items`` lists) and the conversation as chat
messages up to and including this response's output (what a request continuing it with
``previous_response_id`` puts before its own input, read in one look-up however long the
conversation). Instructions are not part of the conversation: OpenAI documents that they are
not carried over.

Every record lives ``ttl_s`` and is at most ``max_record_bytes`` (a longer conversation is not
stored and says so in a log line and a metric); there are at most ``max_entries`` per tenant
(the oldest go first), and in memory at most ``max_total_bytes`` for all tenants together (a
tenant over its share gives up its own records first: ``memory``). Records are kept in memory (one gateway instance) or in Redis (shared by
every instance, through ``shared_state.redis_url``). A tenant's records are under a key derived
from its name, and a record read back is checked to be the caller's: a tenant can never read,
list or delete another's, and an unknown id and another tenant's id both answer 404.

A response relayed from an upstream that keeps state itself (``responses: passthrough``) lives
upstream, under the gateway's one key for every tenant: the store keeps only an ownership record
(``StoredResponse.relayed``: the id and its tenant, bounded and shared like every record), which
a ``previous_response_id`` must find before it is relayed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The store did not answer in time (Redis down or slow)."""


class RecordTooLarge(Exception):
    """The record is over ``max_record_bytes``: it is not stored."""


@dataclass(frozen=True, slots=True)
class StoreLimits:
    ttl_s: int = 30 * 24 * 3600  # OpenAI keeps stored responses 30 days
    max_record_bytes: int = 4 * 1024 * 1024
    max_entries: int = 10_000  # per tenant
    max_total_bytes: int = 256 * 1024 * 1024  # the in-memory store, all tenants together


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    tenant: str
    relayed: bool = False  # the response lives upstream: this record only says whose it is

    @classmethod
    def ownership(cls, tenant: str, response_id: str) -> StoredResponse:
        """The record of a relayed response (``responses: passthrough``) that ``tenant`` owns."""
        return cls({"id": response_id}, [], [], tenant, relayed=True)

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def encode(self) -> bytes:
        data: dict[str, Any] = {
            "t": self.tenant,
            "r": self.response,
            "i": self.input_items,
            "m": self.messages,
        }
        if self.relayed:
            data["u"] = True
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        data = json.loads(raw)
        return cls(
            response=data["r"],
            input_items=data["i"],
            messages=data["m"],
            tenant=data["t"],
            relayed=data.get("u", False),
        )


def tenant_key(tenant: str) -> str:
    """The tenant's part of every key: a digest, so names never shape keys."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class ResponseStore(Protocol):
    limits: StoreLimits

    async def put(self, record: StoredResponse) -> None:
        """Store ``record``; raises ``RecordTooLarge`` or ``StoreUnavailable``."""
        ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's record, or None (unknown, expired, or another tenant's)."""
        ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def aclose(self) -> None: ...


def open_store(redis_url: str | None, limits: StoreLimits | None = None) -> ResponseStore:
    """In Redis when ``redis_url`` is set (needs the ``cache`` extra), else in memory."""
    limits = limits or StoreLimits()
    if redis_url:
        from gateway.conversations.redis_store import RedisResponseStore

        return RedisResponseStore(redis_url, limits)
    from gateway.conversations.memory import MemoryResponseStore

    return MemoryResponseStore(limits)
