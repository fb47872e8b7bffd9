"""An Anthropic backend behind the gateway, called with the official openai client.

The fake Anthropic API (tests/e2e/anthropic_fake.py) refuses any request the real one would, so
each test also proves the translated request was well formed.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, serve
from tests.e2e.anthropic_fake import API_KEY
from tests.e2e.conftest import KEY_ENV, AnthropicFactory, RunningAnthropic
from tests.e2e.limits_helpers import metric, settled

MESSAGES: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]
WEATHER: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def anthropic_policy(url: str, more: str = "", fallbacks: str = "[]", surfaces: str = "") -> str:
    return f"""
backends:
  claude:
    kind: anthropic
    base_url: "{url}"
    api_key_env: {KEY_ENV}
{more}
models:
  c: {{backend: claude, model: claude-test-1, fallbacks: {fallbacks}}}
{surfaces}
"""


async def test_chat_is_translated_both_ways(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="c", messages=MESSAGES, temperature=0.2, stop=["\n\n"], user="u-1"
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "Hello from the fake Claude."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.id.startswith("msg_fake") and reply.model == "claude-test-1"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (13, 7)
    assert reply.usage.total_tokens == 20
    assert raw.headers["x-gateway-replica"].startswith("claude/")
    assert raw.headers["content-type"].startswith("application/json")
    seen = up.fake.requests[-1]
    assert seen.headers["x-api-key"] == API_KEY
    assert seen.headers["anthropic-version"] == "2023-06-01"
    sent = seen.body
    assert sent["system"] == [{"type": "text", "text": "You are terse."}]
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}
    ]
    assert sent["max_tokens"] == 4096  # the documented default
    assert (sent["model"], sent["temperature"], sent["stop_sequences"]) == (
        "claude-test-1",
        0.2,
        ["\n\n"],
    )
    assert sent["metadata"] == {"user_id": "u-1"}
    await gw.client.chat.completions.create(model="c", messages=MESSAGES, max_tokens=50)
    assert up.fake.requests[-1].body["max_tokens"] == 50


async def test_streaming_with_usage(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic(pieces=5)
    gw = await make_gateway(anthropic_policy(up.url))
    stream = await gw.client.chat.completions.create(
        model="c", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    roles, texts, finishes, usage = [], [], [], None
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            roles.append(delta.role)
            texts.append(delta.content or "")
            finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert roles[0] == "assistant"
    assert "".join(texts) == "Hello from the fake Claude."
    assert len([t for t in texts if t]) == 5
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (13, 7)
    assert up.fake.requests[-1].body["stream"] is True
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            gw.base_url + "/chat/completions",
            json={"model": "c", "messages": MESSAGES, "stream": True},
        ) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        body = await r.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b"event:" not in body and b"content_block" not in body  # nothing Anthropic leaks


async def test_tool_calling_round_trip(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("tool_use")
    question: Any = [{"role": "user", "content": "Weather in Paris?"}]
    first = await gw.client.chat.completions.create(
        model="c", messages=question, tools=WEATHER, tool_choice="required"
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.id == "toolu_01" and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    sent = up.fake.requests[-1].body
    assert sent["tools"][0]["name"] == "get_weather"
    assert sent["tools"][0]["input_schema"]["required"] == ["city"]
    assert sent["tool_choice"] == {"type": "any"}
    # The tool's answer goes back: the fake checks it answers the tool_use of the turn before.
    follow_up: Any = [
        *question,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
    ]
    second = await gw.client.chat.completions.create(model="c", messages=follow_up, tools=WEATHER)
    assert second.choices[0].message.content == "The tool said: 18C and sunny"
    turns = up.fake.requests[-1].body["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"][1] == {
        "type": "tool_use",
        "id": "toolu_01",
        "name": "get_weather",
        "input": {"city": "Paris", "unit": "celsius"},
    }
    assert turns[2]["content"][0]["type"] == "tool_result"
    assert turns[2]["content"][0]["tool_use_id"] == "toolu_01"


async def test_streamed_tool_call_is_assembled_by_the_client(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("tool_use")
    stream = await gw.client.chat.completions.create(
        model="c",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=WEATHER,
        stream=True,
    )
    name, call_id, arguments, finish = "", None, "", None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            call_id = call.id or call_id
            if call.function is not None:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (call_id, name, finish) == ("toolu_01", "get_weather", "tool_calls")
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}


async def test_a_streamed_tool_call_without_input_has_json_arguments(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """Anthropic streams a call of a tool without parameters as ``input: {}`` and one empty
    ``partial_json``: the client still gets ``{}``, as in the whole answer."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    clock: Any = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    question: Any = [{"role": "user", "content": "What time is it?"}]
    up.fake.queue("tool_use_no_input", "tool_use_no_input")
    whole = await gw.client.chat.completions.create(model="c", messages=question, tools=clock)
    calls = whole.choices[0].message.tool_calls
    assert calls is not None and calls[0].type == "function"
    assert calls[0].function.arguments == "{}"
    async with gw.client.chat.completions.stream(
        model="c", messages=question, tools=clock
    ) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed is not None and streamed[0].function.name == "now"
    assert streamed[0].function.arguments == "{}"


@pytest.mark.parametrize(
    ("status", "error_class", "type_"),
    [
        (429, openai.RateLimitError, "rate_limit_error"),
        (400, openai.BadRequestError, "invalid_request_error"),
        (404, openai.NotFoundError, "not_found_error"),
    ],
)
async def test_upstream_4xx_keeps_its_status_in_openai_shape(
    make_anthropic: AnthropicFactory,
    make_gateway: GatewayFactory,
    status: int,
    error_class: type[openai.APIStatusError],
    type_: str,
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    for stream in (False, True):
        up.fake.queue(f"status:{status}")
        with pytest.raises(error_class) as info:
            await gw.client.chat.completions.create(model="c", messages=MESSAGES, stream=stream)
        assert info.value.status_code == status
        assert info.value.body == {
            "message": f"fake {status}",
            "type": type_,
            "param": None,
            "code": type_,
        }
    assert len(up.fake.requests) == 2  # a 4xx is the client's: never retried


async def claude_with_fallback(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> tuple[RunningAnthropic, RunningAnthropic, RunningGateway]:
    """Model ``c`` on one fake Anthropic backend, falling back to a second (``claude2``)."""
    first = await make_anthropic()
    second = await make_anthropic(reply="from the second")
    more = f"""  claude2:
    kind: anthropic
    base_url: "{second.url}"
    api_key_env: {KEY_ENV}"""
    gw = await make_gateway(anthropic_policy(first.url, more, fallbacks="[claude2]"))
    return first, second, gw


@pytest.mark.parametrize("status", [529, 500])
async def test_5xx_falls_back_to_a_second_anthropic_backend(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory, status: int
) -> None:
    first, second, gw = await claude_with_fallback(make_anthropic, make_gateway)
    first.fake.queue(f"status:{status}")
    raw = await gw.client.chat.completions.with_raw_response.create(model="c", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "from the second"
    assert raw.headers["x-gateway-replica"].startswith("claude2/")
    assert len(first.fake.requests) == 1 and len(second.fake.requests) == 1
    assert second.fake.requests[-1].body["model"] == "c"  # a bare fallback keeps the alias


@pytest.mark.parametrize(
    ("action", "outcome"), [("error_first", "http_5xx"), ("html_200", "bad_answer")]
)
async def test_a_200_stream_that_fails_before_its_message_falls_back(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory, action: str, outcome: str
) -> None:
    """An error event before message_start (Anthropic overloaded, after its 200: counted as
    a 5xx) or a page that is no stream: nothing went to the client yet, so the next target
    answers, as for a 529 status."""
    first, second, gw = await claude_with_fallback(make_anthropic, make_gateway)
    first.fake.queue(action)
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="c", messages=MESSAGES, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    assert text == "from the second"
    assert raw.headers["x-gateway-replica"].startswith("claude2/")
    assert len(first.fake.requests) == 1 and len(second.fake.requests) == 1
    counted = {
        (sample.labels["backend"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(gw.metrics.render().decode())
        if family.name == "llm_gateway_upstream_attempts"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted == {("claude", outcome): 1.0, ("claude2", "ok"): 1.0}


async def test_a_whole_message_to_a_stream_request_is_streamed(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    """A server that ignores ``stream`` and answers one JSON message: the client gets the
    stream it asked for, as from any backend."""
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("ignore_stream")
    stream = await gw.client.chat.completions.create(
        model="c", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the fake Claude."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (13, 7)


async def test_fallbacks_between_vllm_and_anthropic_both_ways(
    make_anthropic: AnthropicFactory, make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    claude = await make_anthropic()
    vllm = await make_fake()
    policy = f"""
backends:
  claude: {{kind: anthropic, base_url: "{claude.url}", api_key_env: {KEY_ENV}}}
  pool: {{kind: vllm, replicas: ["{vllm.url}"], health: {{interval_s: 60}}}}
models:
  c: {{backend: claude, model: claude-test-1, fallbacks: [{{backend: pool, model: fake-model}}]}}
  v: {{backend: pool, model: fake-model, fallbacks: [{{backend: claude, model: claude-test-1}}]}}
"""
    gw = await make_gateway(policy)
    claude.fake.queue("status:529")
    raw = await gw.client.chat.completions.with_raw_response.create(model="c", messages=MESSAGES)
    assert raw.headers["x-gateway-replica"].startswith("pool/")
    assert raw.parse().choices[0].message.content == "hello from the fake upstream"
    assert vllm.fake.requests[-1].body["messages"] == MESSAGES  # the OpenAI body, untouched
    vllm.fake.queue("status:503")
    stream = await gw.client.chat.completions.create(model="v", messages=MESSAGES, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Hello from the fake Claude."
    assert claude.fake.requests[-1].body["model"] == "claude-test-1"


async def test_error_event_mid_stream_is_the_final_sse_error(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic(pieces=6)
    gw = await make_gateway(anthropic_policy(up.url))
    up.fake.queue("midstream_error")
    stream = await gw.client.chat.completions.create(model="c", messages=MESSAGES, stream=True)
    seen = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
    assert seen[0] == "" and "".join(s or "" for s in seen)  # the text before the error came
    assert "Overloaded" in info.value.message
    # Metered on what Anthropic counted (message_start: 11, + 2 read from its cache), not on
    # the gateway's estimate of the prompt.
    await settled(gw)
    assert await metric([gw], "llm_gateway_tokens_total", kind="input") == 13
    assert await metric([gw], "llm_gateway_tokens_total", kind="cached_input") == 2


async def test_what_anthropic_cannot_do_is_400_before_any_upstream_call(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    gw = await make_gateway(anthropic_policy(up.url))
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(model="c", messages=MESSAGES, n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(
            model="c", messages=MESSAGES, logit_bias={"50256": -100}
        )
    assert info.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.completions.create(model="c", prompt="once upon")
    assert "answers chat, Responses and Messages requests" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.embeddings.create(model="c", input="x")
    assert "answers chat, Responses and Messages requests" in info.value.message
    assert up.fake.requests == []


async def test_exact_cache_stores_and_replays_a_translated_stream(
    make_anthropic: AnthropicFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_anthropic()
    surfaces = """surfaces:
  chat:
    match: {header: chat}
    cache: {exact: true}"""
    gw = await make_gateway(anthropic_policy(up.url, surfaces=surfaces))

    async def ask() -> tuple[str, str | None]:
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="c",
            messages=MESSAGES,
            temperature=0,
            stream=True,
            extra_headers={"X-Surface": "chat"},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        return text, raw.headers.get("x-gateway-cache")

    assert await ask() == ("Hello from the fake Claude.", "miss")
    assert await ask() == ("Hello from the fake Claude.", "exact")
    assert len(up.fake.requests) == 1


async def test_a_200_without_a_message_is_the_replicas_bad_answer(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error object (or a page) answered with a 200: the chat client's 502, counted as the
    replica's ``bad_answer`` as on every other path (it was ``http_5xx``: the translator made
    it a 502 before the attempt was judged)."""

    async def error_200(request: web.Request) -> web.Response:
        body = {"type": "error", "error": {"type": "overloaded_error", "message": "hidden"}}
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/messages", error_200)
    runner, url = await serve(app)
    monkeypatch.setenv(KEY_ENV, API_KEY)
    try:
        gw = await make_gateway(anthropic_policy(url))
        with pytest.raises(openai.InternalServerError) as refused:
            await gw.client.chat.completions.create(model="c", messages=MESSAGES)
        assert refused.value.status_code == 502 and "hidden" not in refused.value.message
        attempts = "llm_gateway_upstream_attempts_total"
        assert await metric([gw], attempts, outcome="bad_answer") >= 1
        assert await metric([gw], attempts, outcome="http_5xx") == 0
    finally:
        await runner.cleanup()
