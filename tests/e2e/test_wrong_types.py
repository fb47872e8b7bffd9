"""Every field of a full request of each API, given a value of each wrong type: an answer or a
4xx in the caller's format, never a 500 of the gateway's own, never an error in its log, never
a request left waiting or an attempt left counted against its replica.

Rich requests (tools, tool results, images, structured output, logprobs...) for chat
completions, completions, embeddings, the Responses API and Anthropic's Messages API, streamed
and not; each JSON path in them is replaced, one at a time, by each value of ``WRONG`` (about
6,000 requests against a fake vLLM replica, a few seconds).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.conftest import FakeFactory, GatewayFactory, build_policy, pool_policy, vllm
from tests.e2e.conftest import KEY_ENV, AnthropicFactory

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
    "tools": [TOOL], "tool_choice": "auto", "max_tokens": 20, "n": 1, "stop": ["x"],
    "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
    "stream_options": {"include_usage": True}, "seed": 1, "user": "u",
}  # fmt: skip
CHAT_MORE: dict[str, Any] = {
    "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi"}],
    "reasoning_effort": "low", "modalities": ["text"], "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"},
    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "object"}}},
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [TOOL],
    "max_completion_tokens": 5, "logit_bias": {"50256": -100}, "frequency_penalty": 0.1,
    "metadata": {"a": "b"}, "store": False,
}  # fmt: skip
RESPONSES: dict[str, Any] = {
    "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "hi"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
        ]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ],
    "instructions": "be nice", "tool_choice": "auto", "max_output_tokens": 20,
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "temperature": 0.5, "metadata": {"a": "b"}, "store": False, "user": "u",
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
    "parallel_tool_calls": True, "truncation": "disabled",
}  # fmt: skip
RESPONSES_MORE: dict[str, Any] = {
    "input": "hi", "tool_choice": {"type": "function", "name": "f"},
    "tools": [{"type": "function", "name": "f", "parameters": {}}],
    "previous_response_id": "resp_x", "top_logprobs": 2,
}  # fmt: skip
MESSAGES: dict[str, Any] = {
    "max_tokens": 2000, "system": [{"type": "text", "text": "sys"}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}},
        ]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"}, "temperature": 0.5, "top_k": 5, "stop_sequences": ["x"],
    "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
}  # fmt: skip
COMPLETIONS: dict[str, Any] = {
    "prompt": ["a", "b"],
    "max_tokens": 5,
    "echo": False,
    "logprobs": 2,
    "suffix": "s",
    "stop": "x",
}
EMBEDDINGS: dict[str, Any] = {"input": ["a", "b"], "encoding_format": "float", "dimensions": 8}
REQUESTS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", CHAT_MORE),
    ("/v1/completions", COMPLETIONS),
    ("/v1/embeddings", EMBEDDINGS),
    ("/v1/responses", RESPONSES),
    ("/v1/responses", RESPONSES_MORE),
    ("/v1/messages", MESSAGES),
    ("/v1/messages/count_tokens", {k: MESSAGES[k] for k in ("system", "messages", "tools")}),
]
WRONG: list[Any] = [5, "x", [], {}, None, -1, True, 1.5, [{}], {"a": []}, [5], 10**30]
WAIT = aiohttp.ClientTimeout(total=20)  # a hang, not a slow answer on a loaded 2-core machine
# What the fake replica would take literally (10**30 choices), as a real one would refuse.
_SIZES = {"n", "best_of", "max_tokens", "max_output_tokens", "max_completion_tokens"}


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if at:
        yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*at, index))


def _with(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    where: Any = out
    for step in path[:-1]:
        where = where[step]
    where[path[-1]] = value
    return out


@pytest.mark.parametrize("backend", ["vllm", "openai", "cascade", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_wrong_type_anywhere_is_never_a_500(
    make_fake: FakeFactory,
    make_anthropic: AnthropicFactory,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    backend: str,
) -> None:
    """Against a vLLM replica (requests relayed, or translated to chat), an OpenAI-compatible
    API, a cascade of two (the small tier judged first), and Anthropic's API (every request
    translated to it: the gateway's own checks of what it writes there)."""
    anthropic = None
    if backend == "vllm":
        gw = await make_gateway(pool_policy([(await make_fake()).url]))
    elif backend == "openai":
        external = {"kind": "openai", "base_url": (await make_fake()).url}
        gw = await make_gateway(build_policy({"ext": external}, {"m": {"backend": "ext"}}))
    elif backend == "cascade":
        small, large = vllm((await make_fake()).url), vllm((await make_fake()).url)
        tiers = {"tiers": ["small", "large"], "mode": "cascade", "commit": {"tokens": 4}}
        gw = await make_gateway(build_policy({"small": small, "large": large}, {"m": tiers}))
    else:
        anthropic = await make_anthropic()
        claude = {"kind": "anthropic", "base_url": anthropic.url, "api_key_env": KEY_ENV}
        gw = await make_gateway(build_policy({"claude": claude}, {"m": {"backend": "claude"}}))
    failures: list[tuple[str, tuple[Any, ...], str, int]] = []
    sent = 0
    async with aiohttp.ClientSession() as session:
        for route, fields in REQUESTS:
            body = {"model": "m", **fields}
            if not route.endswith("embeddings"):
                body["stream"] = stream
            for path in _paths(body):
                for value in WRONG:
                    if path[-1] in _SIZES and value == 10**30:
                        continue
                    caplog.clear()
                    data = json.dumps(_with(body, path, value))
                    try:
                        async with session.post(gw.root + route, data=data, timeout=WAIT) as r:
                            text = await r.text()
                    except TimeoutError:  # a request left waiting (a leak, a hang)
                        pytest.fail(f"{route} with {value!r} at {path} had no answer in 20 s")
                    sent += 1
                    logged = [x for x in caplog.records if x.levelno >= logging.ERROR]
                    if (r.status >= 500 and "internal_error" in text) or logged:
                        failures.append((route, path, repr(value), r.status))
    if anthropic is not None:
        # Values the real API refuses reach the fake by design here (it answers 400 as the
        # real one does); the fixture would fail the test on them.
        anthropic.fake.problems.clear()
    assert sent > 2500
    assert not failures, failures[:20]
    # Every attempt ended: no replica still counts one outstanding.
    left = {r.name: r.outstanding for p in gw.runtime.pools.values() for r in p.replicas}
    assert set(left.values()) == {0}, left
