"""One third-party Python client against the gateway: ``python probe.py <client> <base> <model>``.

Run by ``deploy.local.client_matrix`` with the interpreter of a virtual environment holding the
clients (not the gateway's). Each probe calls the gateway the way the client is used by default
and prints one line per API it tried: ``ok <client> <version> <api> <detail>`` or
``FAIL <client> <version> <api> <error>``. The tiny test model writes gibberish, so a probe
checks the shape of what came back (text, usage, events), not its meaning.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUESTION = "Say hello."


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def report(client: str, package: str, api: str, fn: Callable[[], str]) -> bool:
    try:
        detail = fn()
    except Exception as exc:  # a probe reports any failure of the client, whatever it is
        tail = traceback.format_exception_only(exc)[-1].strip()
        print(f"FAIL\t{client}\t{version(package)}\t{api}\t{tail[:300]}", flush=True)
        return False
    print(f"ok\t{client}\t{version(package)}\t{api}\t{detail[:120]!r}", flush=True)
    return True


def openai_python(base: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused")

    def chat() -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8
        )
        assert r.usage is not None
        assert r.usage.completion_tokens > 0
        return r.choices[0].message.content or ""

    def chat_stream() -> str:
        parts: list[str] = []
        for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, stream=True
        ):
            parts.extend(ch.delta.content or "" for ch in c.choices)
        return "".join(parts)

    def responses() -> str:
        r = client.responses.create(model=model, input=QUESTION, max_output_tokens=8)
        assert r.usage is not None
        assert r.usage.output_tokens > 0
        follow = client.responses.create(
            model=model, input="Again.", previous_response_id=r.id, max_output_tokens=4
        )
        assert follow.usage is not None
        assert follow.usage.input_tokens > r.usage.input_tokens
        return r.output_text

    def responses_stream() -> str:
        # 8 tokens usually end as `response.incomplete` (max_output_tokens), as OpenAI's API
        # ends them; the helper's get_final_response() wants `response.completed`.
        with client.responses.stream(model=model, input=QUESTION, max_output_tokens=8) as s:
            last = [e for e in s if e.type in ("response.completed", "response.incomplete")]
        return f"{last[-1].type}: {last[-1].response.output_text}"

    for api, fn in [
        ("chat", chat),
        ("chat stream", chat_stream),
        ("responses + previous_response_id", responses),
        ("responses stream", responses_stream),
    ]:
        report("openai-python", "openai", api, fn)


def anthropic_python(base: str, model: str) -> None:
    from anthropic import Anthropic

    client = Anthropic(base_url=base, api_key="unused")
    hello: Any = [{"role": "user", "content": QUESTION}]

    def create() -> str:
        m = client.messages.create(model=model, max_tokens=8, messages=hello)
        assert m.usage.output_tokens > 0
        return "".join(b.text for b in m.content if b.type == "text")

    def stream() -> str:
        with client.messages.stream(model=model, max_tokens=8, messages=hello) as s:
            return "".join(s.text_stream)

    def count() -> str:
        return str(client.messages.count_tokens(model=model, messages=hello).input_tokens)

    def models() -> str:
        return ",".join(m.id for m in client.models.list().data)

    for api, fn in [
        ("messages", create),
        ("messages stream", stream),
        ("count_tokens", count),
        ("models", models),
    ]:
        report("anthropic-python", "anthropic", api, fn)


def openai_agents(base: str, model: str) -> None:
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    from agents import Agent, Runner, set_default_openai_client
    from openai import AsyncOpenAI

    def run() -> str:
        set_default_openai_client(AsyncOpenAI(base_url=base + "/v1", api_key="unused"), False)
        agent = Agent(name="probe", instructions="Be brief.", model=model)
        result = asyncio.run(Runner.run(agent, QUESTION, max_turns=1))
        return str(result.final_output)

    report("openai-agents", "openai-agents", "responses (default)", run)


def langchain(base: str, model: str) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    def chat() -> str:
        llm = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=model, max_tokens=8)
        return str(llm.invoke(QUESTION).content)

    def responses() -> str:
        llm = ChatOpenAI(
            base_url=base + "/v1", api_key="unused", model=model, max_tokens=8,
            use_responses_api=True,
        )  # fmt: skip
        return str(llm.invoke(QUESTION).content)

    def stream() -> str:
        llm = ChatOpenAI(
            base_url=base + "/v1", api_key="unused", model=model, max_tokens=8,
            use_responses_api=True,
        )  # fmt: skip
        return "".join(str(c.content) for c in llm.stream(QUESTION))

    def messages() -> str:
        llm = ChatAnthropic(base_url=base, api_key="unused", model=model, max_tokens=8)
        return str(llm.invoke(QUESTION).content)

    report("langchain-openai", "langchain-openai", "chat", chat)
    report("langchain-openai", "langchain-openai", "responses (use_responses_api)", responses)
    report("langchain-openai", "langchain-openai", "responses stream", stream)
    report("langchain-anthropic", "langchain-anthropic", "messages", messages)


def litellm_client(base: str, model: str) -> None:
    import litellm

    def chat() -> str:
        r = litellm.completion(
            model=f"openai/{model}", api_base=base + "/v1", api_key="unused",
            messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
        )  # fmt: skip
        return str(r.choices[0].message.content)

    def responses() -> str:
        r = litellm.responses(
            model=f"openai/{model}", api_base=base + "/v1", api_key="unused",
            input=QUESTION, max_output_tokens=8,
        )  # fmt: skip
        return json.dumps(r.usage.model_dump() if r.usage else None)

    def messages() -> str:
        r = asyncio.run(
            litellm.anthropic.messages.acreate(
                model=f"anthropic/{model}", api_base=base, api_key="unused",
                messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
            )
        )  # fmt: skip
        return json.dumps(r)[:100] if isinstance(r, dict) else str(r)

    report("litellm", "litellm", "chat", chat)
    report("litellm", "litellm", "responses", responses)
    report("litellm", "litellm", "anthropic messages", messages)


def llm_cli(base: str, model: str) -> None:
    """Simon Willison's ``llm`` with the gateway as an extra OpenAI-compatible model."""

    def run() -> str:
        with tempfile.TemporaryDirectory() as home:
            config = f"- model_id: gateway\n  model_name: {model}\n  api_base: {base}/v1\n"
            Path(home, "extra-openai-models.yaml").write_text(config)
            env = {**os.environ, "LLM_USER_PATH": home, "OPENAI_API_KEY": "unused"}
            exe = Path(sys.executable).with_name("llm")
            out = subprocess.run(
                [str(exe), "-m", "gateway", "-o", "max_tokens", "8", QUESTION],
                env=env, capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            return out.stdout.strip()

    report("llm", "llm", "chat (CLI)", run)


def llama_index(base: str, model: str) -> None:
    """LlamaIndex's OpenAI-compatible class (its ``OpenAI`` class refuses model names it does
    not know, before any request)."""
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=model, api_base=base + "/v1", api_key="unused", is_chat_model=True, max_tokens=8
    )

    def chat() -> str:
        return str(llm.complete(QUESTION))

    def stream() -> str:
        return "".join(r.delta or "" for r in llm.stream_complete(QUESTION))

    report("llama-index", "llama-index-llms-openai-like", "chat (OpenAILike)", chat)
    report("llama-index", "llama-index-llms-openai-like", "chat stream", stream)


PROBES = {
    "openai-python": openai_python,
    "anthropic-python": anthropic_python,
    "openai-agents": openai_agents,
    "langchain": langchain,
    "litellm": litellm_client,
    "llm": llm_cli,
    "llama-index": llama_index,
}

if __name__ == "__main__":
    name, base_url, model_name = sys.argv[1:4]
    PROBES[name](base_url, model_name)
