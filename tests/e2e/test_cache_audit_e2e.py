"""The semantic cache's production audit and its no-generalise rules, through the real gateway
(the fake upstream, the official openai client, the real embedding model and gate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from tests.cache.conftest import RedisServer
from tests.conftest import FakeFactory, GatewayFactory, RunningGateway, pool_policy

LONG_ANSWER = (
    "Open the sign-in page, choose Forgot password, enter your email address and follow the "
    "link we send you to pick a new password; the link stays valid for one hour."
)


def policy(
    url: str, semantic: dict[str, Any], rules: dict[str, str] | None = None, **sections: Any
) -> str:
    cache: dict[str, Any] = {"exact": True, "semantic": semantic}
    if rules is not None:
        cache["rules"] = rules
    surfaces = {"chat": {"match": {"header": "chat"}, "cache": cache}}
    return pool_policy([url], surfaces=surfaces, **sections)


async def ask(gw: RunningGateway, text: str, **kwargs: Any) -> str | None:
    raw = await gw.client.chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": text}],
        temperature=0,
        extra_headers={"X-Surface": "chat"},
        **kwargs,
    )
    raw.parse()
    await gw.runtime.cache.drain()  # type: ignore[union-attr]  # fills and audits
    kind: str | None = raw.headers.get("x-gateway-cache")
    return kind


async def report(gw: RunningGateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/admin/cache") as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def test_audit_measures_false_hits_tightens_and_is_bounded(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply=LONG_ANSWER)
    semantic = {"audit_fraction": 1.0, "audit_per_minute": 2}
    gw = await make_gateway(policy(up.url, semantic))
    assert await ask(gw, "How do I reset my password?") == "miss"
    assert await ask(gw, "How can I reset my password?") == "semantic"
    assert len(up.fake.requests) == 2  # the audit asked upstream too, after the answer
    audit = (await report(gw))["audit"]
    assert audit["sent"] == 1 and audit["namespaces"]["chat"]["audited"] == 1
    assert audit["namespaces"]["chat"]["false_hits"] == 0
    assert (await report(gw))["tightened_thresholds"] == {}

    # The upstream now answers something else: the next audited hit is a false hit.
    up.fake.settings.reply = "Paris."
    assert await ask(gw, "how can i reset my password") == "semantic"
    body = await report(gw)
    chat = body["audit"]["namespaces"]["chat"]
    assert (chat["audited"], chat["false_hits"], chat["tightenings"]) == (2, 1, 1)
    assert chat["upper95"] > 0.01
    shipped = gw.runtime.cache.cache.semantic.gate.verifier.threshold  # type: ignore[union-attr]
    assert body["tightened_thresholds"]["chat"] > shipped
    assert chat["threshold"] == body["tightened_thresholds"]["chat"]

    # audit_per_minute: 2 were sent this minute, a third semantic hit is not audited.
    sent_before = len(up.fake.requests)
    served = await ask(gw, "How can I reset my password?")
    if served == "semantic":
        assert len(up.fake.requests) == sent_before
        assert (await report(gw))["audit"]["skipped_over_budget"] == 1
    async with aiohttp.ClientSession() as s, s.get(gw.root + "/metrics") as r:
        metrics = await r.text()
    assert 'llm_gateway_cache_audits_total{namespace="chat",outcome="false_hit"} 1.0' in metrics
    assert 'llm_gateway_cache_audit_requests_total{event="sent"} 2.0' in metrics
    assert 'llm_gateway_cache_false_hit_upper{namespace="chat"}' in metrics

    # The operator may go back to the shipped operating point.
    async with aiohttp.ClientSession() as s, s.delete(gw.root + "/admin/cache/thresholds") as r:
        assert r.status == 200
    assert (await report(gw))["tightened_thresholds"] == {}


async def reload(gw: RunningGateway) -> None:
    async with aiohttp.ClientSession() as s, s.post(gw.root + "/admin/reload") as r:
        assert r.status == 200, await r.text()


async def test_reloads_of_cache_store_keep_raised_thresholds_audits_and_counters(
    make_fake: FakeFactory,
    make_gateway: GatewayFactory,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """A reload that changed any ``cache_store`` setting built a new cache stage: the audit's
    raised threshold (lowered only by DELETE /admin/cache/thresholds, says the README), the
    audit book and every counter started from nothing. A new setting for the same store
    retunes it (the in-memory entries stay); a new store takes over the rest."""
    up = await make_fake(reply=LONG_ANSWER)
    semantic = {"audit_fraction": 1.0, "audit_per_minute": 10}
    path = tmp_path / "policy.yaml"
    path.write_text(policy(up.url, semantic))
    gw = await make_gateway(path.read_text(), policy_path=path)
    assert await ask(gw, "How do I reset my password?") == "miss"
    up.fake.settings.reply = "Paris."  # the audit's fresh answer differs: a false hit
    assert await ask(gw, "How can I reset my password?") == "semantic"
    before = await report(gw)
    assert before["tightened_thresholds"]["chat"] > 0
    assert before["audit"]["namespaces"]["chat"]["false_hits"] == 1

    path.write_text(policy(up.url, semantic, cache_store={"timeout_ms": 80}))
    await reload(gw)
    assert gw.runtime.cache is not None and gw.runtime.cache.timeout_s == 0.08
    assert await report(gw) == before
    assert await ask(gw, "How do I reset my password?") == "exact"  # the entry stayed

    store = {"redis_url": redis_server.url, "timeout_ms": 500}
    path.write_text(policy(up.url, semantic, cache_store=store))
    await reload(gw)  # a new store: empty, the rest goes on
    after = await report(gw)
    assert after["tightened_thresholds"] == before["tightened_thresholds"]
    assert after["audit"] == before["audit"]
    assert after["stats"]["exact_hits"] == before["stats"]["exact_hits"] + 1
    assert after["stats"]["semantic_hits"] == before["stats"]["semantic_hits"]
    assert await ask(gw, "How do I reset my password?") == "miss"
    assert (await report(gw))["stats"]["misses"] == before["stats"]["misses"] + 1


async def test_statement_hits_are_audited_against_min_precision(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """A news-like statement is served by the statement gate; its audit is kept under
    ``<namespace>/statements`` and measured against 1 - min_precision."""
    up = await make_fake(reply=LONG_ANSWER)
    semantic = {"audit_fraction": 1.0, "audit_per_minute": 10, "min_precision": 0.98}
    gw = await make_gateway(policy(up.url, semantic))
    news = "Police said the man was arrested at his home late on Friday night."
    assert await ask(gw, news) == "miss"
    up.fake.settings.reply = "Paris."  # the audit's fresh answer differs: a false hit
    assert await ask(gw, "The man was arrested at his home late Friday night, police said.") == (
        "semantic"
    )
    body = await report(gw)
    audited = body["audit"]["namespaces"]
    assert set(audited) == {"chat/statements"}
    statements = audited["chat/statements"]
    assert (statements["audited"], statements["false_hits"], statements["tightenings"]) == (1, 1, 1)
    gate = gw.runtime.cache.cache.semantic.gate  # type: ignore[union-attr]
    shipped = gate.verifier.threshold_for_statements(0.98)  # type: ignore[union-attr]
    assert body["tightened_thresholds"]["chat/statements"] > shipped
    assert "chat" not in body["tightened_thresholds"]  # the request gate was not touched
    async with (
        aiohttp.ClientSession() as s,
        s.delete(gw.root + "/admin/cache/thresholds?namespace=chat") as r,
    ):
        assert r.status == 200
    assert (await report(gw))["tightened_thresholds"] == {}


async def test_no_audit_when_turned_off(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake(reply=LONG_ANSWER)
    gw = await make_gateway(policy(up.url, {"audit_fraction": 0}))
    await ask(gw, "How do I reset my password?")
    assert await ask(gw, "How can I reset my password?") == "semantic"
    assert len(up.fake.requests) == 1
    assert (await report(gw))["audit"]["sent"] == 0


async def test_answers_that_do_not_generalise(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    up = await make_fake()
    gw = await make_gateway(policy(up.url, {"audit_fraction": 0}))
    # The user's own records: never cached (not even exactly): the cache is skipped.
    assert await ask(gw, "Where is my order?") == "skip"
    assert await ask(gw, "Where is my order?") == "skip"
    assert len(up.fake.requests) == 2
    # The present moment: the same request hits exactly, a paraphrase does not.
    assert await ask(gw, "What is the weather in Boston today?") == "miss"
    assert await ask(gw, "What is the weather in Boston today?") == "exact"
    assert await ask(gw, "What's the weather like in Boston today?") == "miss"
    # Tools: exact only.
    tool: Any = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    assert await ask(gw, "How do I reset my password?", tools=[tool]) == "miss"
    assert await ask(gw, "How do I reset my password?", tools=[tool]) == "exact"
    assert await ask(gw, "How can I reset my password?", tools=[tool]) == "miss"
    # Per-surface settings turn a rule off.
    relaxed = await make_gateway(policy(up.url, {"audit_fraction": 0}, {"personal": "exact"}))
    assert await ask(relaxed, "Where is my order?") == "miss"
    assert await ask(relaxed, "Where is my order?") == "exact"


async def test_the_audit_reads_its_answer_like_the_relay(
    make_fake: FakeFactory, make_gateway: GatewayFactory
) -> None:
    """Bounded by server.max_response_bytes (it read any size), and a replica that answers the
    audit with an HTML page has it counted against its health (it counted as a success)."""
    up = await make_fake(reply=LONG_ANSWER)
    semantic = {"audit_fraction": 1.0, "audit_per_minute": 10}
    gw = await make_gateway(policy(up.url, semantic) + "server:\n  max_response_bytes: 4096\n")
    assert await ask(gw, "How do I reset my password?") == "miss"
    replica = gw.runtime.pools["up"].replicas[0]
    up.fake.queue("big:200000")
    assert await ask(gw, "How can I reset my password?") == "semantic"
    up.fake.queue("html")
    assert await ask(gw, "how can i reset my password") == "semantic"
    audit = (await report(gw))["audit"]
    assert (audit["sent"], audit["failed"]) == (2, 2), audit
    assert replica.consecutive_failures == 1 and replica.last_error, replica
