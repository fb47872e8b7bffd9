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
        model="c", messages=QUESTION, reasoning_effort="low", max_completion_tokens=100
    )
    sent = up.fake.requests[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent["max_tokens"] == 100 + 2048
    message: Any = reply.choices[0].message
    assert message.content == "Hello from the fake Claude."
    assert message.reasoning_content == "Let me think."
    response = await gw.client.responses.create(
        model="c", input="Hi", reasoning={"effort": "high"}, max_output_tokens=64
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert up.fake.requests[-1].body["thinking"]["budget_tokens"] == 24576


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
