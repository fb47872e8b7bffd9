"""The cache stage through the real gateway: real Redis, the official openai client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from tests.cache.conftest import RedisServer
from tests.cache.test_operators import DIFFERENT
from tests.cache.test_wording import NEAR_NAMES, STATEMENT_ONE_WORD, STATEMENT_SWAPS_AND_NUMBERS
from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy

QUESTION: Any = [{"role": "user", "content": "What is the boiling point of water at sea level?"}]


EXACT: dict[str, Any] = {"exact": True}


def policy(url: str, cache: dict[str, Any], surface: str = "chat", **sections: Any) -> str:
    """One fake backend; the surface ``chat`` (X-Surface: chat) caches with ``cache``."""
    match = {"match": {"header": "chat"}} if surface == "chat" else {}
    return pool_policy([url], surfaces={surface: {**match, "cache": cache}}, **sections)


async def ask(
    gw: RunningGateway, messages: Any = QUESTION, **kwargs: Any
) -> tuple[str, str | None]:
    headers = {"X-Surface": "chat", **kwargs.pop("extra_headers", {})}
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=messages, temperature=0, extra_headers=headers, **kwargs
    )
    reply = raw.parse()
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    return reply.choices[0].message.content or "", raw.headers.get("x-gateway-cache")


async def test_exact_hit_skips_the_upstream_and_replays_as_stream(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=3)
    gw = await make_gateway(policy(up.url, EXACT))
    assert await ask(gw) == ("hello from the fake upstream", "miss")
    text, kind = await ask(gw)
    assert (text, kind) == ("hello from the fake upstream", "exact")
    assert len(up.fake.requests) == 1
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m",
        messages=QUESTION,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Surface": "chat"},
    )
    assert raw.headers["x-gateway-cache"] == "exact"
    chunks = [c async for c in raw.parse()]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "hello from the fake upstream"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 0
    assert len(up.fake.requests) == 1


async def test_streamed_answers_are_stored_and_only_complete_ones(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(chunks=4)
    gw = await make_gateway(policy(up.url, EXACT))
    up.fake.queue("midstream_drop")
    stream = await gw.client.chat.completions.create(
        model="m",
        messages=QUESTION,
        temperature=0,
        stream=True,
        extra_headers={"X-Surface": "chat"},
    )
    with pytest.raises(Exception, match="upstream"):
        async for _ in stream:
            pass
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    stream = await gw.client.chat.completions.create(
        model="m",
        messages=QUESTION,
        temperature=0,
        stream=True,
        extra_headers={"X-Surface": "chat"},
    )
    assert (
        "".join([c.choices[0].delta.content or "" async for c in stream]) == "tok0 tok1 tok2 tok3 "
    )
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    assert len(up.fake.requests) == 2  # the truncated stream was not stored
    text, kind = await ask(gw)
    assert (text, kind) == ("tok0 tok1 tok2 tok3 ", "exact")
    assert len(up.fake.requests) == 2


async def test_cache_control_temperature_and_other_surfaces(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url, EXACT))
    await ask(gw, extra_headers={"Cache-Control": "no-store"})
    assert (await ask(gw))[1] == "miss"  # no-store: nothing was kept
    assert (await ask(gw, extra_headers={"Cache-Control": "no-cache"}))[1] == "skip"
    assert (await ask(gw))[1] == "exact"
    hot: Any = [{"role": "user", "content": "Write a poem."}]
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=hot, temperature=0.9, extra_headers={"X-Surface": "chat"}
    )
    await gw.runtime.cache.drain()  # type: ignore[union-attr]
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=hot, temperature=0.9, extra_headers={"X-Surface": "chat"}
    )
    assert raw.headers["x-gateway-cache"] == "skip"  # temperature > 0 is not cached
    assert raw.headers["x-gateway-cache-skip"] == "temperature"
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m", messages=QUESTION, temperature=0
    )
    assert "x-gateway-cache" not in raw.headers  # the default surface has no cache


async def test_tenants_never_share_entries(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
    redis_server: RedisServer,
) -> None:
    monkeypatch.setenv("CACHE_TEST_KEY_A", "tenant-a-key-1")
    monkeypatch.setenv("CACHE_TEST_KEY_B", "tenant-b-key-1")
    up = await make_fake()
    tenants = {
        "a": {"api_keys": ["${CACHE_TEST_KEY_A}"]},
        "b": {"api_keys": ["${CACHE_TEST_KEY_B}"]},
    }
    yaml = policy(up.url, EXACT, tenants=tenants, cache_store={"redis_url": redis_server.url})
    gw_a = await make_gateway(yaml, api_key="tenant-a-key-1")
    gw_b = await make_gateway(yaml, api_key="tenant-b-key-1")
    assert (await ask(gw_a))[1] == "miss"
    assert (await ask(gw_a))[1] == "exact"
    assert (await ask(gw_b))[1] == "miss"  # same question, same Redis, other tenant
    assert len(up.fake.requests) == 2


async def test_two_gateways_share_redis_and_survive_its_death(
    make_fake: FakeFactory, make_gateway: GatewayFactory, redis_server: RedisServer
) -> None:
    up = await make_fake()
    store = {"redis_url": redis_server.url, "timeout_ms": 50}
    first = await make_gateway(policy(up.url, EXACT, cache_store=store))
    second = await make_gateway(policy(up.url, EXACT, cache_store=store))
    assert (await ask(first))[1] == "miss"
    assert (await ask(second))[1] == "exact"  # stored by the other instance
    redis_server.stop()
    for i in range(5):  # Redis is gone: every request still answers, as a miss
        text, kind = await ask(first, messages=[{"role": "user", "content": f"q{i}"}])
        assert text == "hello from the fake upstream"
        assert kind == "miss"
    redis_server.start()
    for _ in range(100):  # the store notices Redis is back within its retry interval
        await ask(first, messages=[{"role": "user", "content": "after"}])
        if (await ask(first, messages=[{"role": "user", "content": "after"}]))[1] == "exact":
            break
        await asyncio.sleep(0.1)
    assert (await ask(first, messages=[{"role": "user", "content": "after"}]))[1] == "exact"
    async with aiohttp.ClientSession() as s, s.get(first.root + "/metrics") as r:
        text = await r.text()
    assert 'llm_gateway_cache_events_total{event="unavailable"}' in text


async def cache_events(gw: RunningGateway) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        lines = (await r.text()).splitlines()
    prefix = 'llm_gateway_cache_events_total{event="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


async def test_a_lookup_behind_its_embedding_is_a_timeout_not_an_unavailable_store(
    make_fake: FakeFactory, make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-memory store always answers: a lookup cut short while the embedder is behind
    was counted as the store unavailable."""
    up = await make_fake()
    cache = {"exact": True, "semantic": {"audit_fraction": 0}}
    gw = await make_gateway(policy(up.url, cache, cache_store={"timeout_ms": 50}))
    await ask(gw, messages=[{"role": "user", "content": "How do I reset my password?"}])
    embedder = gw.runtime.embedder
    assert embedder is not None
    embed = embedder.embed

    async def behind(texts: Any) -> Any:
        await asyncio.sleep(3.0)  # far past the lookup's 0.05 + 0.5 s
        return await embed(texts)

    monkeypatch.setattr(embedder, "embed", behind)
    paraphrase = [{"role": "user", "content": "How can I reset my password?"}]
    assert (await ask(gw, messages=paraphrase))[1] == "miss"
    events = await cache_events(gw)
    assert events["timeouts"] == 1.0
    assert events["unavailable"] == 0.0


async def test_cache_counters_never_go_back_when_a_reload_turns_the_cache_off_and_on(
    make_fake: FakeFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The stage a reload turned off took its counters with it: the next that turned the
    cache on counted from zero, which Prometheus reads as a reset."""
    up = await make_fake()
    path = tmp_path / "policy.yaml"

    async def reload(text: str) -> None:
        path.write_text(text)
        async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
            assert r.status == 200, await r.text()

    path.write_text(policy(up.url, EXACT))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert [(await ask(gw))[1] for _ in range(2)] == ["miss", "exact"]
    before = await cache_events(gw)
    assert (before["misses"], before["exact_hits"]) == (1.0, 1.0)

    await reload(pool_policy([up.url]))  # no cache: no series, which is no reset
    assert gw.runtime.cache is None and await cache_events(gw) == {}
    await reload(policy(up.url, EXACT))
    assert (await ask(gw))[1] == "miss"  # a new store, empty
    after = await cache_events(gw)
    assert after == {**before, "misses": 2.0, "stored": before["stored"] + 1}


async def test_admin_purge(make_fake: FakeFactory, make_gateway: GatewayFactory) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url, EXACT))
    await ask(gw)
    assert (await ask(gw))[1] == "exact"
    async with aiohttp.ClientSession() as s:
        async with s.delete(gw.root + "/admin/cache") as r:
            assert r.status == 400
        async with s.delete(gw.root + "/admin/cache", params={"tenant": "anonymous"}) as r:
            assert r.status == 200
            assert (await r.json())["purged"] >= 1
    assert (await ask(gw))[1] == "miss"


async def test_semantic_hit_on_a_paraphrase_and_not_on_a_different_number(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    # No audit: it would ask upstream again for a sampled 2% of semantic hits.
    gw = await make_gateway(policy(up.url, {"exact": True, "semantic": {"audit_fraction": 0}}))
    await ask(gw, messages=[{"role": "user", "content": "How do I reset my password?"}])
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m",
        temperature=0,
        extra_headers={"X-Surface": "chat"},
        messages=[{"role": "user", "content": "How can I reset my password?"}],
    )
    assert raw.headers["x-gateway-cache"] == "semantic"
    assert float(raw.headers["x-gateway-cache-similarity"]) > 0.8
    await ask(
        gw, messages=[{"role": "user", "content": "What was the population of France in 1990?"}]
    )
    _, kind = await ask(
        gw, messages=[{"role": "user", "content": "What was the population of France in 2010?"}]
    )
    assert kind == "miss"
    assert len(up.fake.requests) == 3


SYMBOL_NEAR_MISSES = DIFFERENT[:7]  # the probe's pairs, each a semantic hit before


async def test_no_semantic_hit_across_an_operator_or_a_sign(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """The verifier reads words: these pairs were served each other's answer until the gate
    compared their operators and signs (cache.operators)."""
    up = await make_fake()
    gw = await make_gateway(policy(up.url, {"exact": True, "semantic": {"audit_fraction": 0}}))
    for stored, asked in SYMBOL_NEAR_MISSES:
        await ask(gw, messages=[{"role": "user", "content": stored}])
        _, kind = await ask(gw, messages=[{"role": "user", "content": asked}])
        assert kind == "miss", (stored, asked)
    # Paraphrases still hit, with operators (the first question stored above) or without.
    _, kind = await ask(gw, messages=[{"role": "user", "content": "is x > 5 when x = 7"}])
    assert kind == "semantic"
    await ask(gw, messages=[{"role": "user", "content": "How do I reset my password?"}])
    _, kind = await ask(gw, messages=[{"role": "user", "content": "How can I reset my password?"}])
    assert kind == "semantic"
    assert len(up.fake.requests) == 2 * len(SYMBOL_NEAR_MISSES) + 1


# The wording probe's pairs, one per class, each a semantic hit before: two names a letter
# apart, a statement's swap, a statement's one-word substitution (tests.cache.test_wording).
WORDING_NEAR_MISSES = [NEAR_NAMES[0], STATEMENT_SWAPS_AND_NUMBERS[0], STATEMENT_ONE_WORD[4]]


async def test_no_semantic_hit_across_a_name_a_swap_or_a_word_in_a_statement(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url, {"exact": True, "semantic": {"audit_fraction": 0}}))
    for stored, asked in WORDING_NEAR_MISSES:
        await ask(gw, messages=[{"role": "user", "content": stored}])
        _, kind = await ask(gw, messages=[{"role": "user", "content": asked}])
        assert kind == "miss", (stored, asked)
    # A typo of a dictionary word is still one.
    _, kind = await ask(
        gw, messages=[{"role": "user", "content": "What does np.argmax retrun for a 2D array?"}]
    )
    assert kind == "semantic"
    assert len(up.fake.requests) == 2 * len(WORDING_NEAR_MISSES)


async def test_semantic_hits_through_the_messages_and_responses_apis(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A translated request has the user's text of the chat request it becomes."""
    up = await make_fake()
    cache = {"exact": True, "semantic": {"audit_fraction": 0}}
    gw = await make_gateway(policy(up.url, cache, surface="default"))
    claude = anthropic.AsyncAnthropic(base_url=gw.root, api_key="x", max_retries=0, timeout=20)

    async def message(text: str) -> str | None:
        raw = await claude.messages.with_raw_response.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
            extra_body={"temperature": 0},
        )
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        return raw.headers.get("x-gateway-cache")

    async def response(text: str) -> str | None:
        raw = await gw.client.responses.with_raw_response.create(
            model="m", input=text, temperature=0
        )
        assert raw.parse().output_text == "hello from the fake upstream"
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        return raw.headers.get("x-gateway-cache")

    try:
        assert await message("How do I reset my password?") == "miss"
        assert await message("How can I reset my password?") == "semantic"
        assert await response("How do I change my email address?") == "miss"
        assert await response("How can I change my email address?") == "semantic"
        assert await message("Is x > 5 when x = 7?") == "miss"
        assert await response("Is x < 5 when x = 7?") == "miss"
    finally:
        await claude.close()
    assert len(up.fake.requests) == 4


async def test_a_surface_named_default_applies_when_nothing_else_matches(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url, EXACT, surface="default"))
    for expected in ("miss", "exact"):
        raw = await gw.client.chat.completions.with_raw_response.create(
            model="m", messages=QUESTION, temperature=0
        )
        await gw.runtime.cache.drain()  # type: ignore[union-attr]
        assert raw.headers["x-gateway-cache"] == expected
        assert raw.headers["x-gateway-surface"] == "default"
