"""The tier stage on its own: the choice of a tier and the cascade's hold, verdict and hand-over."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gateway.observability.metrics import GatewayMetrics
from gateway.upstream.attempts import AttemptOpener
from tests.conftest import FakeFactory, RunningFake, build_policy, vllm
from tests.gateway.conftest import RuntimeFactory, make_call

QUESTION: Any = {"model": "auto", "messages": [{"role": "user", "content": "What is 17 * 3?"}]}


class FixedEmbedder:
    """One unit vector for every text: the estimator's score then depends on the text only."""

    def __init__(self) -> None:
        self.calls = 0

    async def embed(self, texts: list[str]) -> Any:
        self.calls += 1
        vector = np.zeros((len(texts), 384), dtype=np.float32)
        vector[:, 0] = 1.0
        return vector


def tiered(small: RunningFake, large: RunningFake, **tier: Any) -> str:
    backends = {"small": vllm(small.url), "large": vllm(large.url)}
    return build_policy(backends, {"auto": {"tiers": ["small", "large"], **tier}})


async def test_route_mode_scores_once_and_picks_by_the_threshold(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    small, large = await make_fake(), await make_fake()
    for threshold, expected in ((-1.0, "large"), (1.0, "small")):
        rt = await make_runtime(tiered(small, large, mode="route", threshold=threshold))
        assert rt.tiers is not None
        embedder = FixedEmbedder()
        call = make_call(rt, QUESTION, embedder=embedder)
        choice = await rt.tiers.choose(call, rt.policy.models["auto"])  # type: ignore[arg-type]
        assert choice.name == expected
        assert choice.targets[0].pool.name == expected
        await call.query.vector()  # the embedding is reused, not recomputed
        assert embedder.calls == 1


async def test_the_cascade_holds_the_commit_point_then_hands_the_attempt_over(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    small, large = await make_fake(chunks=6), await make_fake()
    rt = await make_runtime(
        tiered(small, large, mode="cascade", threshold=1.0, commit={"tokens": 2})
    )
    assert rt.tiers is not None
    call = make_call(rt, {**QUESTION, "stream": True}, embedder=FixedEmbedder())
    config: Any = rt.policy.models["auto"]
    choice = await rt.tiers.choose(call, config)
    opener = AttemptOpener(GatewayMetrics(lambda: []))
    judged = await rt.tiers.judge(call, choice, opener)
    out = await rt.tiers.answer(call, choice, judged, opener)
    assert not judged.escalate and out.held is None
    assert b"tok0" in out.attempt.first and b"tok1" in out.attempt.first  # held, not yet sent
    assert out.headers["x-gateway-tier"] == "small"
    await out.attempt.discard()
    assert large.fake.requests == []


async def test_the_cascade_escalates_and_keeps_nothing_of_the_small_stream(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    small, large = await make_fake(chunks=6), await make_fake()
    rt = await make_runtime(
        tiered(small, large, mode="cascade", threshold=-1.0, commit={"tokens": 2})
    )
    assert rt.tiers is not None
    call = make_call(rt, {**QUESTION, "stream": True}, embedder=FixedEmbedder())
    config: Any = rt.policy.models["auto"]
    choice, opener = await rt.tiers.choose(call, config), AttemptOpener(GatewayMetrics(lambda: []))
    judged = await rt.tiers.judge(call, choice, opener)
    out = await rt.tiers.answer(call, choice, judged, opener)
    assert judged.escalate and out.attempt.target.pool.name == "large"
    assert out.attempt.first == b""
    assert rt.pools["small"].replicas[0].outstanding == 0  # the small attempt was discarded
    await out.attempt.discard()


async def test_whole_mode_reads_the_small_answer_and_keeps_it_as_a_finished_answer(
    make_fake: FakeFactory, make_runtime: RuntimeFactory
) -> None:
    small, large = await make_fake(reply="17 * 3 = 51. #### 51"), await make_fake()
    rt = await make_runtime(tiered(small, large, mode="cascade", threshold=1.0))
    assert rt.tiers is not None
    call = make_call(rt, {**QUESTION, "stream": True}, embedder=FixedEmbedder())
    config: Any = rt.policy.models["auto"]
    started = time.perf_counter()
    choice, opener = await rt.tiers.choose(call, config), AttemptOpener(GatewayMetrics(lambda: []))
    out = await rt.tiers.answer(call, choice, await rt.tiers.judge(call, choice, opener), opener)
    assert out.held is not None and b"#### 51" in out.held
    assert small.fake.requests[-1].body.get("stream") is None  # asked whole
    assert time.perf_counter() - started < 5
