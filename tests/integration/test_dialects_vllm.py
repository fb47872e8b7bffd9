"""The Responses and Messages APIs through the gateway to real vLLM CPU replicas.

Translated onto vLLM's chat completions (the default), and relayed to vLLM's own
``/v1/responses`` (``responses: passthrough``); count_tokens against vLLM's ``/tokenize``.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from deploy.local.localpool import LocalVllmPool
from tests.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.vllm

QUESTION = "Tell me about the standard library."
GREEDY: Any = {"temperature": 0}  # the anthropic SDK no longer takes sampling parameters


def policy(pool: LocalVllmPool, passthrough: bool = False) -> str:
    replicas = ", ".join(f'"{u}"' for u in pool.replicas)
    mode = "responses: passthrough, " if passthrough else ""
    return f"""
backends:
  local: {{kind: vllm, {mode}replicas: [{replicas}], health: {{interval_s: 1}}}}
models:
  default: {{backend: local}}
"""


@pytest.fixture
async def gw(vllm_pool: LocalVllmPool, make_gateway: GatewayFactory) -> RunningGateway:
    return await make_gateway(policy(vllm_pool))


async def test_responses_create_and_stream_translated(
    gw: RunningGateway, vllm_pool: LocalVllmPool
) -> None:
    response = await gw.client.responses.create(
        model="default", input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert response.status in ("completed", "incomplete")
    assert response.model == vllm_pool.model_name
    assert response.usage is not None
    assert response.usage.input_tokens > 0 and 1 <= response.usage.output_tokens <= 8
    events = [
        e
        async for e in await gw.client.responses.create(
            model="default", input=QUESTION, max_output_tokens=8, temperature=0, stream=True
        )
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]
    # 8 tokens usually end at the limit: response.incomplete, as OpenAI's API ends it
    assert last.type == (
        "response.incomplete" if response.status == "incomplete" else "response.completed"
    )
    final = last.response
    assert "".join(deltas) == final.output_text == response.output_text  # temperature 0
    follow = await gw.client.responses.create(
        model="default", input="And more?", previous_response_id=response.id, max_output_tokens=4
    )
    assert follow.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens  # the first turn came along


async def test_responses_passthrough_to_vllms_own_api(
    vllm_pool: LocalVllmPool, make_gateway: GatewayFactory
) -> None:
    gw = await make_gateway(policy(vllm_pool, passthrough=True))
    response = await gw.client.responses.create(
        model="default", input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert response.usage is not None and response.usage.output_tokens >= 1
    async with gw.client.responses.stream(
        model="default", input=QUESTION, max_output_tokens=8, temperature=0
    ) as stream:
        final = await stream.get_final_response()
    assert final.status in ("completed", "incomplete")


async def test_messages_create_stream_and_count_tokens(gw: RunningGateway) -> None:
    client = anthropic.AsyncAnthropic(base_url=gw.root, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]
    try:
        message = await client.messages.create(
            model="default", max_tokens=8, messages=messages, extra_body=GREEDY
        )
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert 1 <= message.usage.output_tokens <= 8
        async with client.messages.stream(
            model="default", max_tokens=8, messages=messages, extra_body=GREEDY
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
        assert text == "".join(b.text for b in message.content if b.type == "text")
        count = await client.messages.count_tokens(model="default", messages=messages)
        prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        assert count.input_tokens == prompt  # vLLM's tokenizer, the prompt it really ran
    finally:
        await client.close()


async def test_a_prefilled_answer_is_continued_by_vllm(
    vllm_pool: LocalVllmPool, make_gateway: GatewayFactory
) -> None:
    """Counted and cached as the prompt vLLM runs: a chat request with the same messages is
    another prompt (a new turn), never served the prefill's cached continuation."""
    cached = "surfaces:\n  default: {cache: {exact: true}}\n"
    gw = await make_gateway(policy(vllm_pool) + cached)
    client = anthropic.AsyncAnthropic(base_url=gw.root, api_key="unused", max_retries=0)
    prefilled: Any = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The standard library"},
    ]
    try:
        message = await client.messages.create(
            model="default", max_tokens=4, messages=prefilled, extra_body=GREEDY
        )
        count = await client.messages.count_tokens(model="default", messages=prefilled)
    finally:
        await client.close()
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="default", max_tokens=4, messages=prefilled, temperature=0
    )
    assert raw.headers["x-gateway-cache"] == "miss"
    chat = raw.parse()
    assert chat.usage is not None
    # The chat request, with vLLM's defaults, closes the assistant's turn and opens another
    # (more prompt tokens); the Messages request continues the prefilled text.
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert 0 < prompt < chat.usage.prompt_tokens
    assert count.input_tokens == prompt
