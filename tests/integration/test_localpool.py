"""The local pool's replicas are real vLLM servers: the official openai client talks to each
directly (no gateway in between), and their Prometheus metrics carry vLLM's names."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from deploy.local.localpool import LocalVllmPool

pytestmark = pytest.mark.vllm


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def metric_values(metrics_url: str, name: str) -> list[float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text: str = response.read().decode()
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    ]


def test_each_replica_serves_the_tiny_model(vllm_pool: LocalVllmPool) -> None:
    assert len(set(vllm_pool.ports)) == len(vllm_pool.replicas) == 2
    for base_url in vllm_pool.replicas:
        with client_for(base_url) as client:
            assert [m.id for m in client.models.list()] == [vllm_pool.model_name]


def test_greedy_chat_is_deterministic_across_calls_and_replicas(
    vllm_pool: LocalVllmPool,
) -> None:
    answers = []
    for base_url in vllm_pool.replicas:
        with client_for(base_url) as client:
            for _ in range(2):
                response = client.chat.completions.create(
                    model=vllm_pool.model_name,
                    messages=[{"role": "user", "content": "Say hello."}],
                    temperature=0,
                    max_tokens=8,
                )
                choice = response.choices[0]
                assert choice.finish_reason in ("length", "stop")
                assert response.usage is not None
                assert 0 < response.usage.completion_tokens <= 8
                assert isinstance(choice.message.content, str)
                answers.append(choice.message.content)
    # Same weights and greedy decoding: replicas are interchangeable, as routing assumes.
    assert len(set(answers)) == 1


def test_streaming_completion_yields_exactly_max_tokens(vllm_pool: LocalVllmPool) -> None:
    for base_url in vllm_pool.replicas:
        with client_for(base_url) as client:
            stream = client.completions.create(
                model=vllm_pool.model_name,
                prompt="def parse(text):\n",
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text_chunks, finish_reasons, usage = [], [], None
            for chunk in stream:
                for choice in chunk.choices:
                    text_chunks.append(choice.text)
                    if choice.finish_reason is not None:
                        finish_reasons.append(choice.finish_reason)
                usage = chunk.usage or usage
            # a busy engine may merge tokens into fewer chunks (on a loaded CI machine, all of a
            # short answer into one), so the count of text chunks is not a fixed number
            assert [t for t in text_chunks if t]
            assert finish_reasons == ["length"]
            assert usage is not None
            assert usage.completion_tokens == 16


def test_metrics_report_running_requests_and_successes(vllm_pool: LocalVllmPool) -> None:
    for replica in vllm_pool.replica_info:
        with client_for(replica.base_url) as client:
            client.completions.create(model=vllm_pool.model_name, prompt="x = ", max_tokens=2)
        running = metric_values(replica.metrics_url, "vllm:num_requests_running")
        assert running, "vllm:num_requests_running missing from /metrics"
        assert all(value >= 0 for value in running)
        assert sum(metric_values(replica.metrics_url, "vllm:request_success_total")) >= 1
