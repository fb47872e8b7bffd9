"""Structured output, reasoning effort and PDF documents on an Anthropic backend, through the real
gateway with the official openai client (the fake Anthropic API refuses what the real one
would: a forced tool with thinking, a budget not under max_tokens, a bad document)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from tests.conftest import GatewayFactory
from tests.e2e.conftest import AnthropicFactory
from tests.e2e.test_anthropic_e2e import anthropic_policy

QUESTION: Any = [{"role": "user", "content": "Capital of France?"}]


class City(BaseModel):
    city: str
    population: int


async def test_parse_with_a_pydantic_model(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    parsed = await gw.client.chat.completions.parse(
        model="c", messages=QUESTION, response_format=City
    )
    message = parsed.choices[0].message
    assert message.parsed == City(city="text", population=1)  # the fake follows the schema
    assert parsed.choices[0].finish_reason == "stop"
    assert not message.tool_calls
    sent = up.fake.requests[-1].body
    assert sent["tool_choice"] == {"type": "tool", "name": "City"}
    assert sent["tools"][0]["input_schema"]["required"] == ["city", "population"]
    async with gw.client.chat.completions.stream(
        model="c", messages=QUESTION, response_format=City
    ) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.parsed == City(city="text", population=1)


async def test_responses_text_format_on_an_anthropic_backend(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    parsed = await gw.client.responses.parse(model="c", input="Capital?", text_format=City)
    assert parsed.output_parsed == City(city="text", population=1)
    assert up.fake.requests[-1].body["tool_choice"] == {"type": "tool", "name": "City"}


async def test_reasoning_effort_is_thinking_and_comes_back_as_reasoning(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    reply = await gw.client.chat.completions.create(
        model="c", messages=QUESTION, reasoning_effort="low"
    )
    sent = up.fake.requests[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent["max_tokens"] == 4096 + 2048  # the default room for the answer, + the budget
    message: Any = reply.choices[0].message
    assert message.content == "Hello from the fake Claude."
    assert message.reasoning_content == "Let me think."
    response = await gw.client.responses.create(
        model="c", input="Hi", reasoning={"effort": "high"}, max_output_tokens=30000
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert up.fake.requests[-1].body["thinking"]["budget_tokens"] == 24576
    assert up.fake.requests[-1].body["max_tokens"] == 30000  # it covers reasoning, as OpenAI's


async def test_thinking_fits_in_the_output_cap_and_the_clients_limit(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """Anthropic counts thinking in max_tokens: the surface's output cap (cap_output) and the
    client's max_completion_tokens bound thinking and answer together, never exceeded."""
    up = await make_anthropic(event_interval_ms=20)
    surfaces = """surfaces:
  fast:
    match: {header: fast}
    budget: {total_ms: 300}
    actions: {cap_output: true}"""
    gw = await make_gateway(anthropic_policy(up.url, surfaces=surfaces))
    fast = {"X-Surface": "fast"}
    warm = await gw.client.chat.completions.create(
        model="c", messages=QUESTION, stream=True, extra_headers=fast
    )
    async for _ in warm:
        pass  # the backend's inter-token latency (~20 ms) is known from here on
    await gw.client.chat.completions.create(
        model="c", messages=QUESTION, reasoning_effort="high", extra_headers=fast
    )
    sent = up.fake.requests[-1].body
    assert sent["max_tokens"] <= 16  # (300 ms - TTFT) / ~20 ms + 1: no room to think
    assert "thinking" not in sent
    await gw.client.chat.completions.create(
        model="c", messages=QUESTION, reasoning_effort="high", max_completion_tokens=5000
    )
    sent = up.fake.requests[-1].body
    assert sent["max_tokens"] == 5000
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 5000 - 256}


async def test_a_pdf_document(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    pdf: Any = {
        "type": "file",
        "file": {"file_data": "data:application/pdf;base64,JVBERi0xLjQK", "filename": "a.pdf"},
    }
    await gw.client.chat.completions.create(
        model="c",
        messages=[{"role": "user", "content": [pdf, {"type": "text", "text": "Summarise."}]}],
    )
    block = up.fake.requests[-1].body["messages"][0]["content"][0]
    assert block["type"] == "document" and block["source"]["data"] == "JVBERi0xLjQK"
    assert json.dumps(block).count("application/pdf") == 1


WEATHER: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


def tool_result(call_id: str) -> Any:
    return {"role": "tool", "tool_call_id": call_id, "content": "18C"}


async def test_a_tool_loop_with_thinking_sends_the_signed_thinking_back(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """Anthropic refuses to continue a tool loop with thinking unless the assistant turn starts
    with the thinking block it signed: answers carry it in ``thinking_blocks`` (whole and
    streamed), and an assistant message that has them gets them back in place."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("tool_use")
    first = await gw.client.chat.completions.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low"
    )
    message: Any = first.choices[0].message
    signed = {"type": "thinking", "thinking": "Let me think.", "signature": "sig-fake-1"}
    assert message.reasoning_content == "Let me think."
    assert message.thinking_blocks == [signed]
    assert message.tool_calls is not None
    echoed = message.model_dump(exclude_none=True)  # as an agent loop sends it back
    second = await gw.client.chat.completions.create(
        model="c",
        messages=[*ASK, echoed, tool_result(message.tool_calls[0].id)],
        tools=WEATHER,
        reasoning_effort="low",
    )
    assert second.choices[0].message.content == "The tool said: 18C"
    sent = up.fake.requests[-1].body
    assert sent["thinking"]["type"] == "enabled"
    assert sent["messages"][1]["content"][0] == signed
    # Streamed: the block comes whole, with its signature, when it ends.
    up.fake.queue("tool_use")
    stream = await gw.client.chat.completions.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low", stream=True
    )
    blocks: list[Any] = []
    calls: list[Any] = []
    thought = ""
    async for chunk in stream:
        delta: Any = chunk.choices[0].delta
        thought += (delta.model_extra or {}).get("reasoning_content") or ""
        blocks += (delta.model_extra or {}).get("thinking_blocks") or []
        calls += delta.tool_calls or []
    assert thought == "Let me think."
    assert blocks == [{**signed, "signature": "sig-fake-3"}]
    call_id = calls[0].id
    assistant: Any = {
        "role": "assistant",
        "content": "Let me check.",
        "thinking_blocks": blocks,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    stream = await gw.client.chat.completions.create(
        model="c",
        messages=[*ASK, assistant, tool_result(call_id)],
        tools=WEATHER,
        reasoning_effort="low",
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "The tool said: 18C"
    assert up.fake.problems == []


async def test_a_tool_loop_without_its_thinking_block_goes_on_without_thinking(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """A client that keeps no thinking_blocks (most do not): the turn that continues the loop
    is sent without thinking, which Anthropic allows, rather than one it refuses."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("tool_use")
    first = await gw.client.chat.completions.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low"
    )
    calls = first.choices[0].message.tool_calls
    assert calls is not None
    bare: Any = {
        "role": "assistant",
        "content": first.choices[0].message.content,
        "tool_calls": [c.model_dump() for c in calls],
    }
    second = await gw.client.chat.completions.create(
        model="c",
        messages=[*ASK, bare, tool_result(calls[0].id)],
        tools=WEATHER,
        reasoning_effort="low",
    )
    assert second.choices[0].message.content == "The tool said: 18C"
    assert "thinking" not in up.fake.requests[-1].body
    # Once the loop ended in an answer, the user's next question is a new turn: thinking again.
    answered: Any = [
        *ASK,
        bare,
        tool_result(calls[0].id),
        {"role": "assistant", "content": "18C in Paris."},
        {"role": "user", "content": "And Rome?"},
    ]
    await gw.client.chat.completions.create(model="c", messages=answered, reasoning_effort="low")
    assert up.fake.requests[-1].body["thinking"]["type"] == "enabled"


RESPONSES_TOOLS: Any = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
]


def sent_thinking(up: Any) -> tuple[Any, Any]:
    """What the fake Anthropic API got last: its ``thinking`` and the assistant turn's first
    block."""
    body = up.fake.requests[-1].body
    return body.get("thinking"), body["messages"][1]["content"][0]


async def test_a_stored_responses_tool_loop_keeps_its_signed_thinking(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """previous_response_id: the stored conversation keeps the signed thinking block (sealed
    in the reasoning item), so the turn that sends the tool's output goes on thinking.
    Before: the signature was dropped and that turn went without thinking."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    for stream in (False, True):
        up.fake.queue("tool_use")
        first: Any
        if stream:
            async with gw.client.responses.stream(
                model="c", input="Weather?", tools=RESPONSES_TOOLS, reasoning={"effort": "low"}
            ) as events:
                first = await events.get_final_response()
        else:
            first = await gw.client.responses.create(
                model="c", input="Weather?", tools=RESPONSES_TOOLS, reasoning={"effort": "low"}
            )
        (reasoning,) = [item for item in first.output if item.type == "reasoning"]
        assert reasoning.encrypted_content  # opaque to the client
        (call,) = [item for item in first.output if item.type == "function_call"]
        output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
        second = await gw.client.responses.create(
            model="c",
            previous_response_id=first.id,
            input=output,
            tools=RESPONSES_TOOLS,
            reasoning={"effort": "low"},
        )
        assert second.output_text == "The tool said: 18C"
        thinking, block = sent_thinking(up)
        assert thinking["type"] == "enabled"
        assert block["type"] == "thinking" and block["thinking"] == "Let me think."
    assert up.fake.problems == []  # every signature sent back was the one the fake gave


async def test_a_stateless_responses_tool_loop_sends_its_reasoning_items_back(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """store: false, the client sends the output items back as input (the Responses API's
    stateless loop): the reasoning item's encrypted_content brings the signed block back. A
    reasoning item that is not the gateway's (another provider's encrypted_content) is left
    out, and the turn goes without thinking rather than be refused."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("tool_use")
    first = await gw.client.responses.create(
        model="c", input="Weather?", tools=RESPONSES_TOOLS, reasoning={"effort": "low"}, store=False
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    ask: Any = [{"role": "user", "content": "Weather?"}]
    low: Any = {"effort": "low"}
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}
    items: Any = [item.model_dump(exclude_none=True) for item in first.output]
    second = await gw.client.responses.create(
        model="c",
        input=[*ask, *items, result],
        tools=RESPONSES_TOOLS,
        reasoning=low,
        store=False,
    )
    assert second.output_text == "The tool said: 18C"
    thinking, block = sent_thinking(up)
    assert thinking["type"] == "enabled" and block["signature"] == "sig-fake-1"
    foreign: Any = [
        {**item, "encrypted_content": "gAAAAB-not-ours"} if item["type"] == "reasoning" else item
        for item in items
    ]
    await gw.client.responses.create(
        model="c", input=[*ask, *foreign, result], tools=RESPONSES_TOOLS, reasoning=low
    )
    thinking, block = sent_thinking(up)
    assert thinking is None and block["type"] != "thinking"
    assert up.fake.problems == []


async def test_a_cached_answer_keeps_its_signed_thinking_streamed_or_not(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """An answer stored from a stream is assembled with its signed thinking blocks, and a hit
    replays them, whole or streamed: a tool loop continued from a cached answer can send them
    back (a stream's answer was stored without them)."""
    up = await make_anthropic()
    cache = "surfaces:\n  default:\n    cache: {exact: true, allow_temperature: true}"
    gw = await make_gateway(anthropic_policy(up.url, surfaces=cache))
    up.fake.queue("tool_use")
    stream = await gw.client.chat.completions.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low", stream=True
    )
    blocks: list[Any] = []
    async for chunk in stream:
        blocks += (chunk.choices[0].delta.model_extra or {}).get("thinking_blocks") or []
    assert blocks and blocks[0]["signature"]
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    sent = len(up.fake.requests)
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low"
    )
    assert raw.headers["x-gateway-cache"] == "exact"
    message: Any = raw.parse().choices[0].message
    assert message.thinking_blocks == blocks and message.tool_calls
    stream = await gw.client.chat.completions.create(
        model="c", messages=ASK, tools=WEATHER, reasoning_effort="low", stream=True
    )
    replayed: list[Any] = []
    async for chunk in stream:
        replayed += (chunk.choices[0].delta.model_extra or {}).get("thinking_blocks") or []
    assert replayed == blocks
    assert len(up.fake.requests) == sent  # both were hits
