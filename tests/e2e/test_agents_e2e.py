"""The openai-agents SDK with its default settings (its default model name and the Responses
API) against the gateway: a run that calls a function tool, then answers."""

from __future__ import annotations

import json

import openai
import pytest
from agents import Agent, Runner, function_tool, set_default_openai_client
from agents.models.default_models import get_default_model

from tests.conftest import FakeFactory, GatewayFactory, build_policy, vllm


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def test_an_agent_run_with_a_tool_call(
    make_fake: FakeFactory, make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no export to OpenAI's servers
    up = await make_fake(reply="It is sunny in Paris.")
    default = get_default_model()  # the model name an Agent without `model` asks for
    policy = build_policy({"up": vllm(up.url)}, {default: {"backend": "up", "model": "fake-model"}})
    gw = await make_gateway(policy)
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    try:
        up.fake.queue("tool_call")
        agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather])
        result = await Runner.run(agent, "Weather in Paris?")
    finally:
        await client.close()
    assert result.final_output == "It is sunny in Paris."
    first, second = (r.body for r in up.fake.requests)
    assert first["model"] == "fake-model"
    assert first["tools"][0]["function"]["name"] == "get_weather"
    assert first["messages"][0] == {"role": "system", "content": "Use the tool."}
    call = second["messages"][-2]["tool_calls"][0]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": "sunny in Paris",
    }
