"""The audit of one semantic hit (``cache.audit`` holds the book-keeping and the rules).

The hit's question goes upstream again as one non-streamed request through the same attempt
machinery as any request (router, retries, fallbacks), without the caller's deadline (the
caller already has its answer); its time is bounded by the backend's ``timeouts.total_s``,
its size by ``server.max_response_bytes``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from cache.audit import AuditBook, answer_text, answers_agree, needs_exact
from cache.calibration import CalibrationTable, PrecisionTable
from cache.gate import audit_key
from gateway.call import Call, Leases
from gateway.protocol import upstream_json
from gateway.protocol.openai import ParsedRequest
from gateway.upstream.whole_answer import read_whole

if TYPE_CHECKING:
    from cache.semantic import CacheHit, ResponseCache
    from gateway.runtime import Destination
    from gateway.upstream.attempts import AttemptOpener
    from policies.cache import SemanticCacheConfig

log = logging.getLogger("llm_gateway.cache")


async def audit(
    cache: ResponseCache,
    book: AuditBook,
    call: Call,
    hit: CacheHit,
    settings: SemanticCacheConfig,
    targets: list[Destination],
    opener: AttemptOpener,
) -> None:
    try:
        fresh_body = await _ask_again(call, targets, opener)
    except Exception as exc:  # the audit never affects a request: count and go on
        book.failed += 1
        log.info("cache audit failed: %s", type(exc).__name__)
        return
    cached, fresh = answer_text(hit.response), answer_text(fresh_body or b"")
    if fresh_body is None or cached is None or fresh is None:
        book.failed += 1
        return
    book.tokens += _tokens(fresh_body)
    similarity = None
    embedder = call.rt.embedder
    if embedder is not None and not needs_exact(cached, fresh):
        vectors = await embedder.embed([cached, fresh])
        similarity = float(vectors[0] @ vectors[1])
    agree = answers_agree(cached, fresh, similarity, settings.audit_min_similarity)
    gate = cache.semantic.gate
    # Statement hits are measured against their own target (the share of hits that may be
    # wrong), kept and tightened apart from the namespace's request hits.
    key = audit_key(hit.namespace or "", hit.pair_kind)
    threshold = hit.threshold if hit.threshold is not None else 0.0
    verifier = gate.verifier
    calibration: CalibrationTable | PrecisionTable | None = None
    bound = settings.max_false_hit_rate
    if hit.pair_kind == "statement":
        bound = 1.0 - settings.min_precision
        if verifier is not None and verifier.statements is not None:
            calibration = verifier.statements.calibration
    elif verifier is not None:
        calibration = verifier.calibration
    raised = book.record(key, agree, threshold, bound, calibration)
    if raised is not None:
        gate.tighten(key, raised)
        log.warning(
            "cache audit: %r false hits above the bound; threshold raised to %.4f", key, raised
        )


async def _ask_again(call: Call, targets: list[Destination], opener: AttemptOpener) -> bytes | None:
    """The question sent upstream as one non-streamed request, without the caller's deadline."""
    parsed = call.parsed
    body = {k: v for k, v in parsed.body.items() if k not in ("stream", "stream_options")}
    quiet: ParsedRequest = replace(parsed, raw=json.dumps(body).encode(), body=body, stream=False)
    again = replace(call, parsed=quiet, deadline=None, leases=Leases(call.leases.request_id))
    with again.leases:
        attempt = await opener.open(again, targets)
        ok = False
        try:  # a broken or unreadable answer counts against its replica, as in the relay
            data = await read_whole(attempt, None, call.rt.policy.server.max_response_bytes)
            ok = attempt.response.status == 200
        finally:
            attempt.finish(ok)
    return data if ok else None


def _tokens(body: bytes) -> int:
    try:
        usage = upstream_json.loads(body).get("usage") or {}
        return int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    except (ValueError, AttributeError, TypeError):
        return 0
