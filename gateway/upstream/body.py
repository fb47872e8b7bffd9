"""The body an attempt sends upstream: the caller's, for the target's model, with the
surface's output cap (``cap_output``: ``max_tokens`` lowered so the answer fits ``total_ms``),
vLLM's continuation of a prefilled assistant turn, without signed thinking (Anthropic's only),
or a provider's translation."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.call import Call
from gateway.protocol.openai import CONTINUE_FINAL_MESSAGE
from gateway.runtime import Destination
from routing.output_cap import cap_max_tokens, requested_max_tokens, with_max_tokens
from routing.replica import Replica


def upstream_body(call: Call, target: Destination, replica: Replica) -> tuple[bytes, bool]:
    """The upstream's request body, and whether ``cap_output`` lowered its max_tokens."""
    parsed, plan, rt = call.parsed, call.plan, call.rt
    total_ms = plan.budget.total_ms
    cap = None
    if plan.actions.cap_output and total_ms is not None and parsed.endpoint.generates:
        cap = cap_max_tokens(
            total_ms=total_ms,
            elapsed_ms=(time.perf_counter() - call.started) * 1000,
            ttft_ms=rt.latency.predict(replica) or 0.0,
            itl_ms=rt.latency.itl_ms(replica.base_url),
            requested=requested_max_tokens(parsed.body),
        )
        if cap is not None:
            call.span.decision({"output_cap": cap})
    if target.provider is not None:
        return target.provider.body(parsed, target.upstream_model, cap), cap is not None
    continues = parsed.continues and target.pool.settings.kind == "vllm"
    if cap is None and not continues and not parsed.thinking:
        return parsed.body_for(target.upstream_model), False
    body = {**parsed.body, "model": target.upstream_model}
    if parsed.thinking:  # signed thinking is Anthropic's: no other API takes it in a message
        body["messages"] = [_without_thinking(m) for m in body["messages"]]
    if cap is not None:
        body = with_max_tokens(body, cap)
    if continues:  # vLLM opens a new assistant turn unless told to continue the last one
        body.update(CONTINUE_FINAL_MESSAGE)
    return json.dumps(body).encode(), cap is not None


def _without_thinking(message: dict[str, Any]) -> dict[str, Any]:
    if "thinking_blocks" not in message:
        return message
    return {k: v for k, v in message.items() if k != "thinking_blocks"}
