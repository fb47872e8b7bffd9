"""One hedged request's span life cycle, as the orchestrator drives it: shared by the tests of
both tracing paths (the OpenTelemetry SDK's and the lean records')."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def run_request(
    tracer: Any, prompt: str = "secret prompt", *, keep_incoming: bool = False
) -> CIMultiDict[str]:
    """What the orchestrator does for one hedged request; returns the upstream headers (the
    caller's own copied in first with ``keep_incoming``)."""
    headers = CIMultiDict({"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    body = {"model": "m", "max_tokens": 16, "temperature": 0.2, "stream": True}
    rs = tracer.start_request(operation="chat", request_model="m", headers=headers, body=body)
    rs.decision({"surface": "voice", "tenant": "team-a", "priority": "interactive", "x": None})
    with rs.child("gateway.cache.lookup", {"gateway.cache.result": "miss"}):
        pass
    with rs.child("gateway.route") as stage:
        stage.set_attribute("gateway.route.reason", "prefix")
    upstream: CIMultiDict[str] = CIMultiDict(headers if keep_incoming else ())
    first = rs.attempt(
        base_url="http://10.0.0.1:8000/v1", upstream_model="llama", backend="b", replica="r1"
    )
    first.inject(upstream)
    hedge = rs.attempt(
        base_url="http://10.0.0.2:8001/v1",
        upstream_model="llama",
        backend="b",
        replica="r2",
        hedge=True,
    )
    hedge.first_chunk()
    first.end("cancelled")
    hedge.end("won", 200)
    rs.first_token(123.0)
    rs.budget_breach("ttft", 100.0, 123.0)
    rs.decision({"hedge.fired": True, "hedge.winner": "hedge", "budget.headroom_ms": -23.0})
    rs.response(
        model="llama",
        input_tokens=5,
        output_tokens=7,
        finish_reasons=["stop"],
        server_url="http://10.0.0.2:8001/v1",
    )
    rs.content(f'[{{"role":"user","content":"{prompt}"}}]', '[{"content":"answer"}]')
    rs.end(200)
    return upstream
