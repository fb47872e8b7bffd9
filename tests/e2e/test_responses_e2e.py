"""OpenAI's Responses API through the real gateway, called with the official openai client.

The backend is the deterministic fake (vLLM-like: it serves chat completions, ``/tokenize`` and
its own ``/v1/responses``); each test also checks what the gateway sent it.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from pydantic import BaseModel

from gateway.protocol.thinking import seal
from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, vllm
from tests.e2e.anthropic_fake import API_KEY, FakeAnthropic, start_fake_anthropic

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TENANTS = """
tenants:
  team-a: {api_keys: ["${TEST_KEY_A}"]}
  team-b: {api_keys: ["${TEST_KEY_B}"]}
"""
KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"


@pytest.fixture(autouse=True)
def _tenant_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_KEY_A", KEY_A)
    monkeypatch.setenv("TEST_KEY_B", KEY_B)


async def test_a_plain_response(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake(cached_tokens=3)
    gw = await make_gateway(pool_policy([up.url]))
    raw = await gw.client.responses.with_raw_response.create(
        model="m", input="Hello", instructions="Be brief.", max_output_tokens=40, temperature=0
    )
    response = raw.parse()
    assert response.output_text == "hello from the fake upstream"
    assert response.status == "completed"
    assert response.id.startswith("resp_")
    assert response.instructions == "Be brief."
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5, 6)
    assert response.usage.input_tokens_details.cached_tokens == 3
    assert response.usage.total_tokens == 11
    assert raw.headers["x-gateway-replica"].startswith("up/")
    sent = up.fake.requests[-1]
    assert sent.path == "/v1/chat/completions"  # translated onto the chat path
    assert sent.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert (sent.body["model"], sent.body["max_completion_tokens"]) == ("fake-model", 40)


async def test_a_streamed_response(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake(chunks=3, cached_tokens=2)
    gw = await make_gateway(pool_policy([up.url]))
    async with gw.client.responses.stream(model="m", input="Hello") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 3
    assert kinds[-1] == "response.completed"
    assert final.output_text == "tok0 tok1 tok2 "
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == 2
    assert up.fake.requests[-1].body["stream_options"] == {"include_usage": True}
    # the plain iterator of create(stream=True) reads the same typed events
    events = [e async for e in await gw.client.responses.create(model="m", input="x", stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_function_tool_round_trip(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    up.fake.queue("tool_call")
    first = await gw.client.responses.create(
        model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="auto"
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    sent = up.fake.requests[-1].body
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tool_choice"] == "auto"
    output: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = await gw.client.responses.create(
        model="m", previous_response_id=first.id, input=[output], tools=[WEATHER]
    )
    assert second.output_text == "hello from the fake upstream"
    assert second.previous_response_id == first.id
    messages = up.fake.requests[-1].body["messages"]
    assert messages[0] == {"role": "user", "content": "Weather in Paris?"}
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


async def test_signed_thinking_is_sent_to_no_backend_but_anthropic(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A reasoning item holding an Anthropic backend's signed thinking, sent to a vLLM (or any
    OpenAI-compatible) backend: the chat messages go without ``thinking_blocks``, a field the
    OpenAI API refuses in a message; the tool loop itself is relayed whole."""
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    block = {"type": "thinking", "thinking": "Let me think.", "signature": "sig-1"}
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": seal([block])},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    answer = await gw.client.responses.create(model="m", input=items, tools=[WEATHER])
    assert answer.output_text == "hello from the fake upstream"
    messages = up.fake.requests[-1].body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    assert all("thinking_blocks" not in m for m in messages)


async def test_a_streamed_function_call(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    up.fake.queue("tool_call")
    async with gw.client.responses.stream(model="m", input="x", tools=[WEATHER]) as stream:
        deltas = [
            e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(deltas) == '{"city": "Paris"}'
    assert [item.type for item in final.output] == ["function_call"]


PARALLEL_CALLS = [("tool_0", {"city": "city-0"}), ("tool_1", {"city": "city-1"})]


@pytest.mark.parametrize("style", ["openai", "object", "no_index", "interleaved"])
async def test_parallel_function_calls_in_every_shape_upstreams_send(
    make_fake: FakeFactory, make_gateway: GatewayFactory, style: str
) -> None:
    """Arguments sent as a JSON object (HF TGI), calls streamed without ``index`` (Gemini's
    OpenAI endpoint), parallel calls' fragments interleaved: each call keeps its own whole
    arguments as JSON text, streamed (every ``.done`` event included) or not."""
    up = await make_fake(tool_calls=2, tool_call_style=style, chunks=1, reply="")
    gw = await make_gateway(pool_policy([up.url]))
    whole = await gw.client.responses.create(model="m", input="x")
    calls = [i for i in whole.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == PARALLEL_CALLS
    assert calls[0].arguments == (
        '{"city":"city-0"}' if style == "object" else '{"city": "city-0"}'
    )
    async with gw.client.responses.stream(model="m", input="x") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == PARALLEL_CALLS
    assert [c.call_id for c in calls] == ["call-0", "call-1"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [arguments for _, arguments in PARALLEL_CALLS]


async def test_previous_response_id_across_two_gateways_sharing_redis(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    up = await make_fake()
    shared = f"shared_state: {{redis_url: '{redis_server.url}'}}\n{TENANTS}"
    one = await make_gateway(pool_policy([up.url], shared), api_key=KEY_A)
    two = await make_gateway(pool_policy([up.url], shared), api_key=KEY_A)
    first = await one.client.responses.create(model="m", input="My name is Ada.")
    second = await two.client.responses.create(
        model="m", input="What is my name?", previous_response_id=first.id
    )
    assert [m["content"] for m in up.fake.requests[-1].body["messages"]] == [
        "My name is Ada.",
        "hello from the fake upstream",
        "What is my name?",
    ]
    fetched = await one.client.responses.retrieve(second.id)
    assert fetched.output_text == second.output_text and fetched.id == second.id
    items = await two.client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    first_item: Any = items.data[0]
    assert first_item.content[0].text == "My name is Ada."
    await two.client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await one.client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:  # OpenAI's answer: a 400 with a code
        await one.client.responses.create(model="m", input="x", previous_response_id=first.id)
    assert gone.value.code == "previous_response_not_found"
    assert gone.value.param == "previous_response_id"


async def test_a_shorter_ttl_on_another_gateway_keeps_its_new_responses(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    """Two gateways on one Redis with different ``ttl_s`` (or one whose reload lowered it): a
    tenant at ``max_entries`` loses its oldest responses, never the one just created."""
    up = await make_fake()
    shared = f"shared_state: {{redis_url: '{redis_server.url}'}}\n{TENANTS}"
    month = await make_gateway(
        pool_policy([up.url], shared + "responses_store: {max_entries: 3}\n"), api_key=KEY_A
    )
    hour = await make_gateway(
        pool_policy([up.url], shared + "responses_store: {max_entries: 3, ttl_s: 3600}\n"),
        api_key=KEY_A,
    )
    old = [await month.client.responses.create(model="m", input=f"old {n}") for n in range(3)]
    new = await hour.client.responses.create(model="m", input="new")
    assert (await month.client.responses.retrieve(new.id)).id == new.id
    await hour.client.responses.create(
        model="m", input="go on", previous_response_id=new.id, store=False
    )
    with pytest.raises(openai.NotFoundError):  # the oldest made room
        await hour.client.responses.retrieve(old[0].id)
    assert (await hour.client.responses.retrieve(old[1].id)).id == old[1].id


async def test_a_tenant_never_reads_anothers_response(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url], TENANTS), api_key=KEY_A)
    mine = await gw.client.responses.create(model="m", input="a secret of team a")
    other = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY_B, max_retries=0)
    try:
        for call in (
            other.responses.retrieve(mine.id),
            other.responses.input_items.list(mine.id),
            other.responses.delete(mine.id),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                await call
            assert "secret" not in str(info.value.body)
        with pytest.raises(openai.BadRequestError) as unknown:  # as an unknown id answers
            await other.responses.create(model="m", input="x", previous_response_id=mine.id)
        assert unknown.value.code == "previous_response_not_found"
        assert "secret" not in str(unknown.value.body)
    finally:
        await other.close()
    assert (await gw.client.responses.retrieve(mine.id)).id == mine.id  # still there


async def test_a_tenant_filling_the_store_never_evicts_anothers_responses(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    bounded = TENANTS + "responses_store: {max_total_bytes: 2000000}\n"
    gw = await make_gateway(pool_policy([up.url], bounded), api_key=KEY_A)
    other = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY_B, max_retries=0)
    try:
        theirs = await other.responses.create(model="m", input="team b's conversation")
        mine = [
            await gw.client.responses.create(model="m", input="x" * 300_000 + str(n))
            for n in range(8)
        ]
        assert (await other.responses.retrieve(theirs.id)).id == theirs.id
        with pytest.raises(openai.NotFoundError):  # the writer's own oldest went
            await gw.client.responses.retrieve(mine[0].id)
        assert (await gw.client.responses.retrieve(mine[-1].id)).id == mine[-1].id
    finally:
        await other.close()


async def test_store_false_is_not_kept(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    response = await gw.client.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await gw.client.responses.retrieve(response.id)


class City(BaseModel):
    city: str
    country: str


async def test_structured_output_with_parse(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply='{"city": "Paris", "country": "France"}')
    gw = await make_gateway(pool_policy([up.url]))
    parsed = await gw.client.responses.parse(
        model="m", input="Capital of France?", text_format=City
    )
    assert parsed.output_parsed == City(city="Paris", country="France")
    fmt = up.fake.requests[-1].body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["schema"]["required"] == ["city", "country"]


async def test_what_cannot_be_served_is_a_400_in_openai_shape(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.responses.create(
            model="m",
            input="x",
            tools=[{"type": "web_search"}],
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        await gw.client.responses.create(model="nope", input="x")
    assert up.fake.requests == []


async def test_an_upstreams_refusal_names_the_callers_parameter(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """``max_output_tokens`` goes upstream as chat's ``max_completion_tokens``: vLLM's refusal
    of it (past the context) named parameters the caller never sent, streamed or not."""
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    for stream in (False, True):
        up.fake.queue("past_context")
        with pytest.raises(openai.BadRequestError) as info:
            await gw.client.responses.create(
                model="m", input="x", max_output_tokens=5000, stream=stream
            )
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "max_output_tokens"
        assert body["message"] == (
            "'max_output_tokens' is too large: 5000. This model's maximum context length is 4096"
            " tokens and your request has 9 input tokens (5000 > 4096 - 9)."
            " (parameter=max_output_tokens, value=5000)"
        )
        assert up.fake.requests[-1].body["max_completion_tokens"] == 5000


async def test_a_tool_output_holds_text_parts_only(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A screenshot in a function_call_output was dropped without a word (the chat API's tool
    message holds text only): a 400 naming the part. Text parts, there and in a message, are
    joined by a line break (they were glued: "Summarize:The report")."""
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    call: Any = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    text: Any = {"type": "input_text", "text": "screenshot:"}
    image: Any = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    output: Any = {"type": "function_call_output", "call_id": "c1", "output": [text, image]}
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.responses.create(model="m", input=[call, output])
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "input[1].output[1]"
    assert up.fake.requests == []
    ask: Any = {"role": "user", "content": [{"type": "input_text", "text": "Summarize:"}, text]}
    output["output"] = [text, {"type": "input_text", "text": "(none)"}]
    await gw.client.responses.create(model="m", input=[ask, call, output])
    messages = up.fake.requests[-1].body["messages"]
    assert (messages[0]["content"], messages[2]["content"]) == (
        "Summarize:\nscreenshot:",
        "screenshot:\n(none)",
    )


async def test_a_cache_hit_is_replayed_as_a_response(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(cached_tokens=4)
    surfaces = "surfaces:\n  default:\n    cache: {exact: true}\n"
    gw = await make_gateway(pool_policy([up.url], surfaces))
    first = await gw.client.responses.create(model="m", input="Boiling point?", temperature=0)
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    raw = await gw.client.responses.with_raw_response.create(
        model="m", input="Boiling point?", temperature=0
    )
    again = raw.parse()
    assert raw.headers["x-gateway-cache"] == "exact"
    assert len(up.fake.requests) == 1
    assert again.output_text == first.output_text and again.id != first.id
    assert again.usage is not None  # nothing was generated for this request
    assert (again.usage.input_tokens, again.usage.output_tokens) == (0, 0)
    assert again.usage.input_tokens_details.cached_tokens == 0
    async with gw.client.responses.stream(
        model="m", input="Boiling point?", temperature=0
    ) as stream:
        streamed = await stream.get_final_response()
    assert streamed.output_text == first.output_text and len(up.fake.requests) == 1


async def test_passthrough_relays_the_upstreams_own_responses_api(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply="straight from upstream")
    policy = build_policy(
        {"up": vllm(up.url, responses="passthrough")},
        {"m": {"backend": "up", "model": "fake-model"}},
    )
    gw = await make_gateway(policy)
    response = await gw.client.responses.create(model="m", input="Hi", temperature=0)
    assert response.output_text == "straight from upstream"
    assert up.fake.requests[-1].path == "/v1/responses"
    assert up.fake.requests[-1].body["model"] == "fake-model"
    async with gw.client.responses.stream(model="m", input="Hi") as stream:
        final = await stream.get_final_response()
    assert final.output_text == "straight from upstream"
    async with aiohttp.ClientSession() as session:
        metrics = await (await session.get(gw.root + "/metrics")).text()
    ok = [line for line in metrics.splitlines() if line.startswith("llm_gateway_requests_total")]
    assert ok and all('status="200"' in line for line in ok)  # no [DONE], not a broken stream


async def test_passthrough_a_tenant_never_continues_anothers_response(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The upstream keeps every tenant's responses under the gateway's one key: the gateway
    relays a ``previous_response_id`` only to the tenant whose answer carried it."""
    up = await make_fake()
    models = {"m": {"backend": "up", "model": "fake-model"}}
    gw = await make_gateway(
        build_policy({"up": vllm(up.url, responses="passthrough")}, models, TENANTS),
        api_key=KEY_A,
    )
    mine = await gw.client.responses.create(model="m", input="a secret of team a")
    async with gw.client.responses.stream(model="m", input="another secret") as stream:
        streamed = await stream.get_final_response()
    other = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY_B, max_retries=0)
    sent = len(up.fake.requests)
    refusals = []
    try:
        for taken in (mine.id, streamed.id, "resp_never_made"):
            with pytest.raises(openai.BadRequestError) as refused:
                await other.responses.create(
                    model="m", input="What did I say before?", previous_response_id=taken
                )
            assert refused.value.code == "previous_response_not_found"
            assert refused.value.param == "previous_response_id"
            refusals.append(json.dumps(refused.value.body).replace(taken, "ID"))
        assert refusals[0] == refusals[1] == refusals[2]  # as an unknown id answers
        assert len(up.fake.requests) == sent  # never relayed
    finally:
        await other.close()
    follow = await gw.client.responses.create(
        model="m", input="go on", previous_response_id=mine.id
    )
    assert up.fake.requests[-1].body["previous_response_id"] == mine.id
    async with gw.client.responses.stream(
        model="m", input="go on", previous_response_id=streamed.id
    ) as stream:
        await stream.get_final_response()
    assert up.fake.requests[-1].body["previous_response_id"] == streamed.id
    # A chain goes on from the owner's newest answer too.
    await gw.client.responses.create(model="m", input="more", previous_response_id=follow.id)
    # Responses kept upstream are not the gateway's to show or delete, for their owner too.
    with pytest.raises(openai.NotFoundError):
        await gw.client.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await gw.client.responses.delete(mine.id)
    await gw.client.responses.create(model="m", input="again", previous_response_id=mine.id)


async def test_passthrough_ownership_is_shared_through_redis(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    up = await make_fake()
    models = {"m": {"backend": "up", "model": "fake-model"}}
    shared = f"shared_state: {{redis_url: '{redis_server.url}'}}\n{TENANTS}"
    policy = build_policy({"up": vllm(up.url, responses="passthrough")}, models, shared)
    one = await make_gateway(policy, api_key=KEY_A)
    two = await make_gateway(policy, api_key=KEY_B)
    mine = await one.client.responses.create(model="m", input="a secret of team a")
    with pytest.raises(openai.BadRequestError) as refused:
        await two.client.responses.create(model="m", input="x", previous_response_id=mine.id)
    assert refused.value.code == "previous_response_not_found"
    assert up.fake.requests[-1].body.get("previous_response_id") is None
    as_a = openai.AsyncOpenAI(base_url=two.base_url, api_key=KEY_A, max_retries=0)
    try:  # the owner continues it on the other instance
        await as_a.responses.create(model="m", input="go on", previous_response_id=mine.id)
    finally:
        await as_a.close()
    assert up.fake.requests[-1].body["previous_response_id"] == mine.id


async def test_responses_over_an_anthropic_backend(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", API_KEY)
    fake = FakeAnthropic()
    runner, url = await start_fake_anthropic(fake)
    try:
        gw = await make_gateway(
            f"""
backends:
  claude: {{kind: anthropic, base_url: "{url}", api_key_env: TEST_ANTHROPIC_KEY}}
models:
  c: {{backend: claude, model: claude-test-1}}
"""
        )
        response = await gw.client.responses.create(model="c", input="Hi", instructions="Terse.")
        assert response.output_text == "Hello from the fake Claude."
        assert response.usage is not None
        assert response.usage.input_tokens_details.cached_tokens == 2
        async with gw.client.responses.stream(model="c", input="Hi") as stream:
            final = await stream.get_final_response()
        assert final.output_text == "Hello from the fake Claude."
        assert fake.problems == []
        assert fake.requests[0].body["system"] == [{"type": "text", "text": "Terse."}]
    finally:
        await runner.cleanup()


async def test_an_openai_backend_translated_and_passthrough(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply="from the api", cached_tokens=1)
    models = {
        "t": {"backend": "api", "model": "fake-model"},
        "p": {"backend": "raw", "model": "fake-model"},
    }
    gw = await make_gateway(
        build_policy(
            {
                "api": {"kind": "openai", "base_url": up.url},
                "raw": {"kind": "openai", "base_url": up.url, "responses": "passthrough"},
            },
            models,
        )
    )
    translated = await gw.client.responses.create(model="t", input="Hi")
    assert translated.output_text == "from the api"
    assert translated.usage is not None and translated.usage.input_tokens_details.cached_tokens == 1
    assert up.fake.requests[-1].path == "/v1/chat/completions"
    relayed = await gw.client.responses.create(model="p", input="Hi")
    assert relayed.output_text == "from the api"
    assert up.fake.requests[-1].path == "/v1/responses"
    assert up.fake.requests[-1].body["model"] == "fake-model"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_of_team_a"}, "conversation"),
        (
            {"input": [{"type": "item_reference", "id": "msg_of_team_a"}]},
            "input[0]",
        ),
        # A reference's type is optional (the openai client's ItemReference): relayed before.
        (
            {"input": [{"role": "user", "content": "Hi"}, {"id": "msg_of_team_a"}]},
            "input[1]",
        ),
        ({"input": [{"id": "msg_of_team_a", "type": None}]}, "input[0]"),
    ],
)
async def test_passthrough_refuses_upstream_state_it_cannot_tell_the_owner_of(
    make_fake: FakeFactory, make_gateway: GatewayFactory, extra: dict[str, Any], param: str
) -> None:
    # The upstream keeps every tenant's conversations and items under the gateway's one key:
    # a conversation id or an item reference of another tenant was relayed and read.
    up = await make_fake()
    models = {"m": {"backend": "up", "model": "fake-model"}}
    gw = await make_gateway(
        build_policy({"up": vllm(up.url, responses="passthrough")}, models, TENANTS),
        api_key=KEY_B,
    )
    body: dict[str, Any] = {"input": "What did we say?", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        await gw.client.responses.create(model="m", **body)
    assert refused.value.param == param
    assert up.fake.requests == []  # never relayed


@pytest.mark.parametrize("stream", [False, True])
async def test_passthrough_relays_reasoning_items_and_containers_only_to_their_owner(
    make_fake: FakeFactory, make_gateway: GatewayFactory, stream: bool
) -> None:
    """A reasoning item sent back by id alone (the openai client's ``input += output``) and a
    code-interpreter container are read by the upstream from its store, which holds every
    tenant's under the gateway's one key: another tenant naming them was relayed (the probe's
    repro). The owner's loop goes on; anyone else's id is a 400, never relayed."""
    up = await make_fake(reasoning="thinking it over")
    models = {"m": {"backend": "up", "model": "fake-model"}}
    policy = build_policy({"up": vllm(up.url, responses="passthrough")}, models, TENANTS)
    gw_a = await make_gateway(policy, api_key=KEY_A)
    tools: Any = [{"type": "code_interpreter", "container": {"type": "auto"}}]
    first: Any
    if stream:
        async with gw_a.client.responses.stream(model="m", input="Hi", tools=tools) as events:
            first = await events.get_final_response()
    else:
        first = await gw_a.client.responses.create(model="m", input="Hi", tools=tools)
    reasoning, call = first.output[0], first.output[1]
    assert reasoning.type == "reasoning" and call.type == "code_interpreter_call"
    again: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": reasoning.id, "summary": []},
        {"role": "user", "content": "Go on"},
    ]
    in_container: Any = [{"type": "code_interpreter", "container": call.container_id}]
    mine = await gw_a.client.responses.create(model="m", input=again, tools=in_container)
    assert mine.output_text and up.fake.requests[-1].body["input"][1]["id"] == reasoning.id
    sent = len(up.fake.requests)
    as_b = openai.AsyncOpenAI(base_url=gw_a.base_url, api_key=KEY_B, max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await as_b.responses.create(model="m", input=again)
        assert refused.value.param == "input[1]"
        with pytest.raises(openai.BadRequestError) as refused:
            await as_b.responses.create(model="m", input="Hi", tools=in_container)
        assert refused.value.param == "tools[0].container"
        # Sent with its encrypted content, an item is the caller's own to send.
        sealed: Any = {**again[1], "encrypted_content": "opaque"}
        await as_b.responses.create(model="m", input=[again[0], sealed])
    finally:
        await as_b.close()
    assert len(up.fake.requests) == sent + 1  # only the self-contained one was relayed


async def test_a_passthrough_response_is_never_evicted_by_the_ids_it_made(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    """Its reasoning item and container are records of the tenant too, counted in
    ``max_entries``: written at once with the response's own, they evicted it (the owner's
    next turn was 400 ``previous_response_not_found``). The response's record is written last."""
    up = await make_fake(reasoning="thinking it over")
    models = {"m": {"backend": "up", "model": "fake-model"}}
    shared = f"shared_state: {{redis_url: '{redis_server.url}'}}\n{TENANTS}"
    shared += "responses_store: {max_entries: 2}\n"
    policy = build_policy({"up": vllm(up.url, responses="passthrough")}, models, shared)
    gw = await make_gateway(policy, api_key=KEY_A)
    tools: Any = [{"type": "code_interpreter", "container": {"type": "auto"}}]
    for _ in range(5):
        first = await gw.client.responses.create(model="m", input="Hi", tools=tools)
        assert len(first.output) == 3  # a reasoning item, a call in a new container, a message
        await gw.client.responses.create(model="m", input="Go on", previous_response_id=first.id)
