from __future__ import annotations

import random
from typing import Any

from cache.keys import CacheRequest, CacheScope, build_request, scope_prefix
from gateway.protocol.openai import Endpoint, user_text

SCOPE = CacheScope("acme", "small", "chat")


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "small",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        **extra,
    }


def test_transport_fields_do_not_change_the_exact_key() -> None:
    plain = build_request(body(), SCOPE)
    streamed = build_request(body(stream=True, stream_options={"include_usage": True}), SCOPE)
    tagged = build_request(body(user="u-1", metadata={"trace": "x"}), SCOPE)
    assert plain.exact_key == streamed.exact_key == tagged.exact_key


def test_key_order_and_text_parts_are_canonical() -> None:
    a = build_request(body(), SCOPE)
    reordered = dict(reversed(list(body().items())))
    parts = body()
    parts["messages"][1]["content"] = [{"type": "text", "text": "What is the capital of France?"}]
    assert build_request(reordered, SCOPE).exact_key == a.exact_key
    assert build_request(parts, SCOPE).exact_key == a.exact_key


def test_numbers_are_compared_as_values() -> None:
    """temperature 0, 0.0 and -0.0 (and 1 / 1.0 anywhere in the request) are one request."""
    keys = {
        (r.exact_key, r.context_key)
        for r in (
            build_request(body(temperature=t, top_p=p, max_tokens=m), SCOPE)
            for t, p, m in ((0, 1, 64), (0.0, 1.0, 64.0), (-0.0, 1, 64))
        )
    }
    assert len(keys) == 1
    assert build_request(body(temperature=0.5), SCOPE) != build_request(
        body(temperature=0.25), SCOPE
    )
    assert (
        build_request(body(seed=True), SCOPE).exact_key
        != build_request(body(seed=1), SCOPE).exact_key
    )


def test_answer_changing_parameters_change_both_keys() -> None:
    base = build_request(body(), SCOPE)
    for extra in (
        {"temperature": 0.7},
        {"max_tokens": 5},
        {"seed": 3},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"stop": "\n"},
        {"logprobs": True},
        {"some_future_field": 1},  # unknown fields are kept: they may matter
    ):
        other = build_request(body(**extra), SCOPE)
        assert other.exact_key != base.exact_key, extra
        assert other.context_key != base.context_key, extra


def test_continuing_the_last_message_changes_both_keys() -> None:
    """A prefill continued and the same messages opening a new turn are two prompts."""
    prefilled = body()
    prefilled["messages"].append({"role": "assistant", "content": "The capital"})
    new_turn = build_request(prefilled, SCOPE)
    continued = build_request(prefilled, SCOPE, continues=True)
    assert continued.exact_key != new_turn.exact_key
    assert continued.context_key != new_turn.context_key


def keys(request: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> CacheRequest:
    """Keys as the gateway builds them: with its one rule for the user's text."""
    if endpoint is Endpoint.COMPLETIONS:
        return build_request(request, SCOPE, "completions", user_text(endpoint, request))
    return build_request(request, SCOPE, "chat/completions", user_text(endpoint, request))


def test_context_key_ignores_only_the_users_text() -> None:
    a = keys(body())
    other_question = body()
    other_question["messages"][1]["content"] = "Which city is France's capital?"
    b = keys(other_question)
    assert a.context_key == b.context_key
    assert a.exact_key != b.exact_key
    assert b.query_text == "Which city is France's capital?"
    other_system = body()
    other_system["messages"][0]["content"] = "You are verbose."
    assert keys(other_system).context_key != a.context_key


def test_without_a_users_text_the_whole_request_is_the_context() -> None:
    tool = body()
    tool["messages"].append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    req = keys(tool)
    assert req.query_text is None
    changed = body()
    changed["messages"][1]["content"] = "Another question"
    changed["messages"].append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    assert keys(changed).context_key != req.context_key  # nothing is left out


def test_completions_prompt_is_the_query() -> None:
    req = keys(
        {"model": "small", "prompt": "Once upon a time", "max_tokens": 8}, Endpoint.COMPLETIONS
    )
    assert req.query_text == "Once upon a time"
    other = keys(
        {"model": "small", "prompt": "Twice upon a time", "max_tokens": 8}, Endpoint.COMPLETIONS
    )
    assert other.context_key == req.context_key and other.exact_key != req.exact_key


def test_scope_is_part_of_every_key_randomized() -> None:
    rng = random.Random(1234)
    words = ["alpha", "beta", "gamma", "delta", ":", "*", "?", "[", "]", ""]
    seen: dict[tuple[str, str], CacheScope] = {}
    for _ in range(2000):
        scope = CacheScope(*("".join(rng.choices(words, k=rng.randint(0, 3))) for _ in range(3)))
        req = build_request(body(), scope)
        for key in (req.exact_key, req.context_key):
            previous = seen.setdefault((key, "k"), scope)
            assert previous == scope, "two scopes share a key"
        assert scope.path().startswith(scope_prefix(scope.tenant))
        assert scope.path().startswith(scope_prefix(scope.tenant, scope.namespace))
