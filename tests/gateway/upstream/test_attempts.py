"""The attempt opener on its own: replica choice, retries, fallbacks, time-outs, finishing."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import Unavailable, UpstreamError, UpstreamTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Telemetry
from gateway.upstream.attempts import AttemptOpener
from policies.server import TelemetryConfig
from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    build_policy,
    closed_port_url,
    pool_policy,
    vllm,
)
from tests.gateway.conftest import RuntimeFactory, make_call

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def opener() -> AttemptOpener:
    return AttemptOpener(GatewayMetrics(lambda: []))


async def test_a_5xx_is_retried_once_on_another_replica_then_the_fallback(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    a, b, c = await make_fake(), await make_fake(), await make_fake(models=("other",))
    a.fake.queue("status:500")
    b.fake.queue("status:502")
    backends = {"up": vllm(a.url, b.url), "spare": vllm(c.url)}
    models = {"m": {"backend": "up", "model": "fake-model", "fallbacks": ["spare"]}}
    rt = await make_runtime(build_policy(backends, models))
    attempt = await opener().open(make_call(rt, BODY), rt.targets("m"))
    try:
        assert attempt.target.pool.name == "spare"
        assert attempt.target.upstream_model == "other"  # the fallback's own first model
        assert attempt.decision.replica.outstanding == 1  # held until finished
    finally:
        body = await attempt.response.read()
        attempt.finish(True)
    assert b"hello" in body
    assert attempt.decision.replica.outstanding == 0
    assert len(a.fake.requests) == len(b.fake.requests) == len(c.fake.requests) == 1


async def test_every_replica_failing_is_a_502_and_none_left_a_503(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    up = await make_fake()
    up.fake.queue("status:500", "status:500")
    rt = await make_runtime(
        build_policy({"up": vllm(up.url, closed_port_url())}, {"m": {"backend": "up"}})
    )
    with pytest.raises(UpstreamError):
        await opener().open(make_call(rt, BODY), rt.targets("m"))
    for replica in rt.pools["up"].replicas:
        replica.mark_down("test")
    with pytest.raises(Unavailable) as info:
        await opener().open(make_call(rt, BODY), rt.targets("m"))
    assert info.value.headers["Retry-After"] == rt.retry_after


async def test_a_timeout_is_not_retried(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    slow, other = await make_fake(), await make_fake()
    slow.fake.queue("hang")
    other.fake.queue("hang")
    backend = vllm(slow.url, other.url, timeouts={"first_byte_s": 0.2})
    rt = await make_runtime(build_policy({"up": backend}, {"m": {"backend": "up"}}))
    with pytest.raises(UpstreamTimeout):
        await opener().open(make_call(rt, BODY), rt.targets("m"))
    assert len(slow.fake.requests) + len(other.fake.requests) == 1  # one wait, not two
    assert all(r.outstanding == 0 for r in rt.pools["up"].replicas)


async def test_the_surface_deadline_shortens_the_wait_for_headers(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    up = await make_fake(latency_ms=2000)
    surfaces = {
        "fast": {
            "match": {"header": "fast"},
            "budget": {"total_ms": 200},
            "actions": {"deadline": True},
        }
    }
    rt = await make_runtime(
        build_policy({"up": vllm(up.url)}, {"m": {"backend": "up"}}, surfaces=surfaces)
    )
    with pytest.raises(UpstreamTimeout):
        await opener().open(make_call(rt, BODY, surface="fast"), rt.targets("m"))


@pytest.mark.parametrize(
    ("action", "stream", "status", "outcome"),
    [
        ("ok", True, 200, "ok"),
        ("midstream_drop", True, 200, "answer_broken"),  # 200 sent, then an error event
        ("status:400", False, 400, "http_4xx"),
        ("ratelimit:0.5", False, 429, "http_429"),
    ],
)
async def test_an_attempts_outcome_is_one_truth_for_its_span_and_its_metric(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    action: str,
    stream: bool,
    status: int,
    outcome: str,
) -> None:
    """Counted when the attempt ends, as its span says it: a stream that breaks after its
    headers is the replica's failure (not ok), and the request's span says how it failed."""
    up = await make_fake()
    up.fake.queue(action)
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=1.0)
    telemetry = Telemetry.from_config(config, {}, exporter=exporter, batch=False)
    gw = await make_gateway(pool_policy([up.url]), telemetry=telemetry)
    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.base_url + "/chat/completions", json={**BODY, "stream": stream}) as r,
    ):
        assert r.status == status
        await r.read()
    counted = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(gw.metrics.render().decode())
        if family.name == "llm_gateway_upstream_attempts"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted == {outcome: 1.0}
    (attempt,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    (root,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    got, root_attrs = dict(attempt.attributes or {}), dict(root.attributes or {})
    assert got["gateway.attempt.outcome"] == outcome
    assert got["http.response.status_code"] == status
    if outcome == "answer_broken":
        assert attempt.status.status_code is StatusCode.ERROR
        assert got["error.type"] == "answer_broken"
        assert root.status.status_code is StatusCode.ERROR
        assert root.status.description == root_attrs["error.type"] == "answer_broken"
        assert root_attrs["http.response.status_code"] == 502
    else:
        assert attempt.status.status_code is StatusCode.UNSET and "error.type" not in got
        assert root.status.status_code is StatusCode.UNSET and "error.type" not in root_attrs


HEDGED = """
surfaces:
  chat:
    match: {header: chat}
    actions: {hedge: {enabled: true, delay_ms: 20, max_fraction: 1.0}}
"""


def _attempts_counted(metrics: GatewayMetrics) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.name == "llm_gateway_upstream_attempts"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def _until_counted(metrics: GatewayMetrics, expected: dict[str, float]) -> None:
    """The attempt is counted when it has unwound, a moment after the client's answer."""
    for _ in range(500):
        if _attempts_counted(metrics) == expected:
            return
        await asyncio.sleep(0.02)
    assert _attempts_counted(metrics) == expected


@pytest.mark.parametrize("why", ["client_left", "hedge_lost"])
async def test_an_attempt_cancelled_before_its_headers_is_counted_as_its_span_says(
    make_fake: FakeFactory, make_gateway: GatewayFactory, why: str
) -> None:
    """The client left, or the hedge won the race, while an attempt waited for its headers: the
    replica got the request, so the attempt is counted, ``cancelled`` as its span says."""
    hanging, answering = await make_fake(), await make_fake()
    hanging.fake.queue("hang")
    exporter = InMemorySpanExporter()
    config = TelemetryConfig(enabled=True, sample_ratio=1.0)
    telemetry = Telemetry.from_config(config, {}, exporter=exporter, batch=False)
    if why == "client_left":
        gw = await make_gateway(pool_policy([hanging.url]), telemetry=telemetry)
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(TimeoutError):
                async with session.post(gw.base_url + "/chat/completions", json=BODY) as r:
                    await r.read()
        expected = {"cancelled": 1.0}
    else:
        gw = await make_gateway(pool_policy([hanging.url, answering.url], HEDGED),
                                telemetry=telemetry)  # fmt: skip
        hedged = []
        for _ in range(2):  # idle replicas take turns: one request starts on the hanging one
            raw = await gw.client.chat.completions.with_raw_response.create(
                model="m", messages=BODY["messages"], extra_headers={"X-Surface": "chat"}
            )
            hedged.append(raw.headers.get("x-gateway-hedge"))
        assert hedged.count("hedge") == 1, hedged
        expected = {"ok": 2.0, "cancelled": 1.0}  # the winner counts as ok (its span: won)
    assert len(hanging.fake.requests) == 1  # the replica got it
    await _until_counted(gw.metrics, expected)
    spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    outcomes = sorted(str((s.attributes or {})["gateway.attempt.outcome"]) for s in spans)
    assert outcomes.count("cancelled") == 1, outcomes
