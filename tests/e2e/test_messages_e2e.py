"""Anthropic's Messages API through the real gateway, called with the official anthropic client.

Over a vLLM-like backend (the deterministic fake) the request is translated onto the chat path;
over a ``kind: anthropic`` backend (the fake Anthropic API, which refuses what the real one
would) it goes through untranslated.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest
from aiohttp import web
from anthropic.types import ModelInfo

from tests.conftest import (
    FakeFactory,
    GatewayFactory,
    RunningGateway,
    build_policy,
    pool_policy,
    serve,
    vllm,
)
from tests.e2e.anthropic_fake import API_KEY, FakeAnthropic, start_fake_anthropic
from tests.e2e.limits_helpers import KEYS, limits_policy, metric

TOOL: Any = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TENANTS = "tenants:\n  team-a: {api_keys: ['${TEST_KEY_A}']}\n"
KEY_A = "key-of-team-a"


@pytest.fixture(autouse=True)
def _tenant_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_KEY_A", KEY_A)


Clients = Callable[..., anthropic.AsyncAnthropic]


@pytest.fixture
async def claude() -> AsyncIterator[Clients]:
    clients: list[anthropic.AsyncAnthropic] = []

    def make(gw: RunningGateway, key: str = "unused", **options: Any) -> anthropic.AsyncAnthropic:
        client = anthropic.AsyncAnthropic(
            base_url=gw.root, api_key=key, max_retries=0, timeout=20, **options
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def test_messages_create_over_a_vllm_backend(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake(cached_tokens=3)
    gw = await make_gateway(pool_policy([up.url]))
    raw = await claude(gw).messages.with_raw_response.create(
        model="m",
        max_tokens=64,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        stop_sequences=["END"],
        cache_control={"type": "ephemeral"},  # the client's automatic caching: accepted
        extra_body={"temperature": 0},  # the SDK no longer takes sampling parameters itself
    )
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "hello from the fake upstream"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 2  # 5 prompt tokens, 3 of them read from a cache
    assert message.usage.cache_read_input_tokens == 3
    assert message.usage.output_tokens == 6
    assert raw.headers["x-gateway-replica"].startswith("up/")
    sent = up.fake.requests[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert (sent.body["max_tokens"], sent.body["stop"]) == (64, ["END"])
    assert sent.body["temperature"] == 0
    assert "cache_control" not in sent.body  # a chat backend caches prefixes by itself


async def test_messages_stream(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake(chunks=3, cached_tokens=1)
    gw = await make_gateway(pool_policy([up.url]))
    async with claude(gw).messages.stream(
        model="m", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "tok0 tok1 tok2 "
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (4, 1)
    assert final.usage.output_tokens == 3
    # The model that answered, as the whole answer names it (message_start said the alias).
    whole = await claude(gw).messages.create(
        model="m", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]
    )
    assert final.model == whole.model == "fake-model"


async def test_tools_round_trip(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    client = claude(gw)
    up.fake.queue("tool_call")
    question: Any = {"role": "user", "content": "Weather in Paris?"}
    first = await client.messages.create(
        model="m", max_tokens=64, messages=[question], tools=[TOOL], tool_choice={"type": "any"}
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert up.fake.requests[-1].body["tool_choice"] == "required"
    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
    }
    second = await client.messages.create(
        model="m",
        max_tokens=64,
        messages=[question, {"role": "assistant", "content": first.content}, result],
        tools=[TOOL],
    )
    assert second.content[0].type == "text"
    messages = up.fake.requests[-1].body["messages"]
    assert messages[1]["tool_calls"][0]["id"] == use.id
    assert messages[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}
    up.fake.queue("tool_call")
    async with client.messages.stream(
        model="m", max_tokens=64, messages=[question], tools=[TOOL]
    ) as stream:
        streamed = await stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]


@pytest.mark.parametrize("style", ["openai", "object", "no_index", "interleaved"])
async def test_parallel_tool_calls_in_every_shape_upstreams_send(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients, style: str
) -> None:
    """Arguments sent as a JSON object (HF TGI), calls streamed without ``index`` (Gemini's
    OpenAI endpoint), parallel calls' fragments interleaved: each ``tool_use`` block keeps its
    own input, streamed or not."""
    up = await make_fake(tool_calls=2, tool_call_style=style, chunks=1, reply="")
    gw = await make_gateway(pool_policy([up.url]))
    client = claude(gw)
    question: Any = {"role": "user", "content": "x"}
    expected = [("call-0", "tool_0", {"city": "city-0"}), ("call-1", "tool_1", {"city": "city-1"})]
    whole = await client.messages.create(model="m", max_tokens=64, messages=[question])
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert [(u.id, u.name, u.input) for u in uses] == expected
    async with client.messages.stream(model="m", max_tokens=64, messages=[question]) as stream:
        streamed = await stream.get_final_message()
    uses = [b for b in streamed.content if b.type == "tool_use"]
    assert [(u.id, u.name, u.input) for u in uses] == expected
    assert streamed.stop_reason == "tool_use"


async def test_count_tokens_uses_vllms_tokenizer(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    count = await claude(gw).messages.count_tokens(
        model="m",
        system="Be brief.",
        messages=[{"role": "user", "content": "one two three"}],
        cache_control={"type": "ephemeral"},
    )
    tokenize = up.fake.requests[-1]
    assert tokenize.path == "/tokenize"
    assert tokenize.body["model"] == "fake-model"
    assert tokenize.body["messages"][-1] == {"role": "user", "content": "one two three"}
    assert count.input_tokens == (3 + 2) + (3 + 3)  # the fake's count: words + 3 per message


async def test_count_tokens_relays_the_tokenizers_refusal_as_messages_does(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    """vLLM's tokenizer refusing the request (an image to a text-only model) is the caller's
    400 in Anthropic's shape with vLLM's message, as ``messages.create`` relays it (it was a
    502: the gateway's fault, by its status)."""
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "iVBORw0KGgo="}}  # fmt: skip
    messages: Any = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude(gw).messages.count_tokens(model="m", messages=messages)
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "fake-model is not a multimodal model",
        },
    }
    assert up.fake.requests[-1].path == "/tokenize"


async def test_count_tokens_never_follows_a_redirect(
    make_gateway: GatewayFactory, claude: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect re-POSTed the prompt (and, to an Anthropic backend, the provider's key) to
    the origin the upstream named, and relayed that origin's answer."""
    canary_hits: list[dict[str, str]] = []

    async def canary(request: web.Request) -> web.Response:
        canary_hits.append(dict(request.headers))
        return web.json_response({"count": 1, "input_tokens": 1})

    canary_app = web.Application()
    canary_app.router.add_post("/{tail:.*}", canary)
    canary_runner, canary_url = await serve(canary_app)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(canary_url + "/steal")

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/{tail:.*}", redirect)
    app.router.add_get("/health", healthy)
    runner, url = await serve(app)
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-provider-secret")
    backends = {
        "up": vllm(url),
        "claude": {"kind": "anthropic", "base_url": url, "api_key_env": "TEST_ANTHROPIC_KEY"},
    }
    models = {"m": {"backend": "up", "model": "fake-model"},
              "c": {"backend": "claude", "model": "claude-test-1"}}  # fmt: skip
    gw = await make_gateway(build_policy(backends, models))
    try:
        for model in ("m", "c"):
            with pytest.raises(anthropic.APIStatusError) as caught:
                await claude(gw).messages.count_tokens(
                    model=model, messages=[{"role": "user", "content": "my secret question"}]
                )
            assert caught.value.status_code == 502
        assert canary_hits == []
    finally:
        await runner.cleanup()
        await canary_runner.cleanup()


async def test_keys_by_x_api_key_or_bearer_and_a_wrong_key(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url], TENANTS))
    hello: Any = [{"role": "user", "content": "Hi"}]
    ok = await claude(gw, KEY_A).messages.create(model="m", max_tokens=8, messages=hello)
    assert ok.content
    bearer = claude(gw, None, auth_token=KEY_A)  # Authorization: Bearer
    assert (await bearer.messages.create(model="m", max_tokens=8, messages=hello)).content
    with pytest.raises(anthropic.AuthenticationError) as info:
        await claude(gw, "wrong").messages.create(model="m", max_tokens=8, messages=hello)
    assert info.value.status_code == 401
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    assert len(up.fake.requests) == 2


async def test_errors_in_anthropics_format(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    client = claude(gw)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(
            model="nope", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    up.fake.queue("status:503")
    with pytest.raises(anthropic.InternalServerError) as down:
        await client.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert down.value.status_code == 502
    assert down.value.body["error"]["type"] == "api_error"  # type: ignore[index]


async def test_anthropics_clients_read_the_request_id(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    """Anthropic's clients read ``request-id``: with ``x-request-id`` only, a message's
    ``_request_id`` and an error's ``request_id`` were always None."""
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    client = claude(gw, default_headers={"x-request-id": "req-caller-1"})
    ask: Any = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    assert (await client.messages.create(**ask))._request_id == "req-caller-1"
    async with client.messages.stream(**ask) as stream:
        await stream.get_final_message()
    assert stream.request_id == "req-caller-1"
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(**{**ask, "model": "nope"})
    assert info.value.request_id == "req-caller-1"
    models = await claude(gw).models.with_raw_response.list()
    assert models.request_id == models.headers["x-request-id"]  # a new id, the same in both
    assert models.request_id
    openai_models = await gw.client.models.with_raw_response.list()
    assert "request-id" not in openai_models.headers  # OpenAI's callers: x-request-id only


async def test_a_prefilled_answer_is_continued(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    """A last assistant message is the start of the answer (Anthropic's prefill): a vLLM backend
    is told to continue it (it opened a new assistant turn), and so is its tokenizer when the
    request's tokens are counted (the count was of a new turn); an OpenAI-compatible API, which
    has no such option, gets the message as it is."""
    vllm_up, api_up = await make_fake(), await make_fake()
    backends = {"up": vllm(vllm_up.url), "api": {"kind": "openai", "base_url": api_up.url}}
    models = {"m": {"backend": "up", "model": "fake-model"},
              "o": {"backend": "api", "model": "fake-model"}}  # fmt: skip
    gw = await make_gateway(build_policy(backends, models))
    prefilled: Any = [
        {"role": "user", "content": "Give me JSON."},
        {"role": "assistant", "content": "{"},
    ]
    for model in ("m", "o"):
        for stream in (False, True):
            await claude(gw).messages.create(
                model=model, max_tokens=8, messages=prefilled, stream=stream
            )
    await claude(gw).messages.create(model="m", max_tokens=8, messages=prefilled[:1])
    # Its token count is of the same prompt: the continued turn, not a new one after it.
    await claude(gw).messages.count_tokens(model="m", messages=prefilled)
    await claude(gw).messages.count_tokens(model="m", messages=prefilled[:1])
    sent = [r.body for r in vllm_up.fake.requests]
    assert [r.path for r in vllm_up.fake.requests][-2:] == ["/tokenize", "/tokenize"]
    assert [(b.get("continue_final_message"), b.get("add_generation_prompt")) for b in sent] == [
        (True, False),
        (True, False),
        (None, None),  # no prefill: vLLM's defaults
        (True, False),
        (None, True),
    ]
    assert sent[0]["messages"][-1] == {"role": "assistant", "content": "{"}
    assert all("continue_final_message" not in r.body for r in api_up.fake.requests)
    assert len(api_up.fake.requests) == 2


async def test_models_in_anthropics_format(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(pool_policy([up.url]))
    page = await claude(gw).models.list()
    assert all(m.type == "model" for m in page.data)
    openai_page = await gw.client.models.list()  # without anthropic-version: OpenAI's format
    assert [m.id for m in page.data] == [m.id for m in openai_page.data]
    assert "m" in [m.id for m in page.data]
    assert all(m.object == "model" for m in openai_page.data)
    one = await claude(gw).models.retrieve("m")  # it was OpenAI's object: no type, no name
    assert (one.type, one.id, one.display_name) == ("model", "m", "m")
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude(gw).models.retrieve("nope")
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert (await gw.client.models.retrieve("m")).object == "model"


async def test_models_are_paged_as_anthropic_pages_them(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    """``limit``, ``after_id`` and ``before_id`` were ignored (one page of every model), and
    each model lacked ``lifecycle``, which anthropic's ``ModelInfo`` requires."""
    up = await make_fake()
    models = {name: {"backend": "up", "model": "fake-model"} for name in ("a", "b", "c")}
    gw = await make_gateway(build_policy({"up": vllm(up.url)}, models))
    names = gw.runtime.model_names()
    assert len(names) >= 3
    client = claude(gw)
    first = await client.models.list(limit=2)
    assert [m.id for m in first.data] == names[:2]
    assert (first.has_more, first.first_id, first.last_id) == (True, names[0], names[1])
    for model in first.data:
        assert ModelInfo.model_validate(model.model_dump(exclude_unset=True)).lifecycle == "active"
    assert [m.id async for m in client.models.list(limit=1)] == names  # page after page
    back = await client.models.list(before_id=names[2], limit=1)
    assert ([m.id for m in back.data], back.has_more) == ([names[1]], True)
    assert (await client.models.list(lifecycle=["retired"])).data == []
    assert (await client.models.retrieve("a")).lifecycle == "active"
    for bad in ({"limit": 0}, {"after_id": "nope"}):
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.models.list(**bad)
        assert info.value.body["type"] == "error"  # type: ignore[index]


# --- a kind: anthropic backend: untranslated ---------------------------------------------------


@pytest.fixture
async def anthropic_gateway(
    make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[FakeAnthropic, RunningGateway]]:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", API_KEY)
    fake = FakeAnthropic()
    runner, url = await start_fake_anthropic(fake)
    gw = await make_gateway(
        f"""
backends:
  claude: {{kind: anthropic, base_url: "{url}", api_key_env: TEST_ANTHROPIC_KEY}}
models:
  c: {{backend: claude, model: claude-test-1}}
"""
    )
    yield fake, gw
    await runner.cleanup()
    assert fake.problems == []


async def test_an_anthropic_backend_gets_the_request_untranslated(
    anthropic_gateway: tuple[FakeAnthropic, RunningGateway], claude: Clients
) -> None:
    fake, gw = anthropic_gateway
    fake.signed["sig-earlier"] = "earlier"  # a thinking block the API gave in an earlier turn
    client = claude(gw)
    system: Any = [{"type": "text", "text": "Terse.", "cache_control": {"type": "ephemeral"}}]
    messages: Any = [
        {"role": "user", "content": "Think first."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "earlier", "signature": "sig-earlier"},
                {"type": "text", "text": "Done."},
            ],
        },
        {"role": "user", "content": "Again."},
    ]
    message = await client.messages.create(
        model="c",
        max_tokens=4096,
        system=system,
        messages=messages,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.usage.cache_read_input_tokens == 2  # Anthropic's own counts, unchanged
    sent = fake.requests[-1]
    assert sent.body["system"] == system and sent.body["messages"] == messages
    assert sent.body["model"] == "claude-test-1"  # only the model is renamed
    assert sent.headers["x-api-key"] == API_KEY  # the backend's key, not the caller's
    async with client.messages.stream(
        model="c", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    ) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "Hello from the fake Claude."  # type: ignore[union-attr]
    count = await client.messages.count_tokens(
        model="c", messages=[{"role": "user", "content": "one two"}]
    )
    assert count.input_tokens == 5
    assert fake.requests[-1].body["model"] == "claude-test-1"


async def test_count_tokens_without_a_tokenizer_is_the_documented_estimate(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    up = await make_fake()
    gw = await make_gateway(
        f'backends:\n  api: {{kind: openai, base_url: "{up.url}"}}\n'
        "models:\n  o: {backend: api, model: fake-model}\n"
    )
    count = await claude(gw).messages.count_tokens(
        model="o", messages=[{"role": "user", "content": "x" * 40}]
    )
    assert count.input_tokens == 10 + 3  # 40 characters / 4, and 3 for the one message
    assert up.fake.requests == []  # nothing asked of the backend


async def test_count_tokens_with_the_gateways_key_refused_is_a_502_as_messages_is(
    make_gateway: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
    claude: Clients,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anthropic refusing the gateway's own key is the operator's problem: the caller gets the
    502 ``/v1/messages`` gives, never the provider's 401 (which would blame the caller's key)."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-WRONG")
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
        client = claude(gw)
        messages: Any = [{"role": "user", "content": "one two"}]
        answers = []
        for call in (
            client.messages.create(model="c", max_tokens=8, messages=messages),
            client.messages.count_tokens(model="c", messages=messages),
        ):
            caplog.clear()
            with pytest.raises(anthropic.InternalServerError) as info:
                await call
            assert info.value.status_code == 502
            assert isinstance(info.value.body, dict) and info.value.body["type"] == "error"
            answers.append(info.value.body)
            logged = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert any("refused the gateway's API key" in r.getMessage() for r in logged)
        assert answers[0] == answers[1]
        assert "x-api-key" not in str(answers[1])  # not the provider's own message
    finally:
        await runner.cleanup()


async def test_count_tokens_holds_the_tenants_request_limit_and_its_model_label(
    make_fake: FakeFactory, make_gateway: GatewayFactory, claude: Clients
) -> None:
    """Each count asks the backend (vLLM's tokenizer, Anthropic's count on the gateway's key):
    a tenant's ``requests_per_minute`` holds for it as for any request (8 of 8 went upstream
    with a limit of 2), and its metric names the model (it said ``unknown``)."""
    up = await make_fake()
    gw = await make_gateway(limits_policy(up.url, None, {"limits": {"requests_per_minute": 2}}))
    counter = claude(gw, KEYS["team-a"])
    ask: Any = {"model": "m", "messages": [{"role": "user", "content": "one two"}]}
    await counter.messages.count_tokens(**ask)
    await counter.messages.count_tokens(**ask)
    with pytest.raises(anthropic.RateLimitError) as refused:
        await counter.messages.count_tokens(**ask)
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert [r.path for r in up.fake.requests] == ["/tokenize", "/tokenize"]
    assert await metric([gw], "llm_gateway_requests_total", model="m", status="200") == 2
    assert await metric([gw], "llm_gateway_rate_limited_total", reason="requests") == 1


async def test_count_tokens_relays_a_refusal_that_is_not_json_in_anthropics_shape(
    make_gateway: GatewayFactory, claude: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy's 413 page before Anthropic's count: Anthropic's error shape, not the page
    labelled as JSON."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(status=413, text="Maximum request body size exceeded.")

    app = web.Application()
    app.router.add_post("/v1/messages/count_tokens", page)
    runner, url = await serve(app)
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", API_KEY)
    try:
        gw = await make_gateway(
            build_policy(
                {
                    "claude": {
                        "kind": "anthropic",
                        "base_url": url,
                        "api_key_env": "TEST_ANTHROPIC_KEY",
                    }
                },
                {"c": {"backend": "claude", "model": "claude-test-1"}},
            )
        )
        with pytest.raises(anthropic.APIStatusError) as refused:
            await claude(gw).messages.count_tokens(
                model="c", messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 413
        assert refused.value.body["type"] == "error"  # type: ignore[index]
    finally:
        await runner.cleanup()
