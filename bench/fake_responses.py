"""The fake upstream's vLLM-like extras: ``POST /tokenize`` and ``POST /v1/responses``.

``/tokenize`` counts a prompt's (or a chat's) whitespace-separated words as its tokens, plus 3
per chat message for the template (a fake tokenizer: only the count's determinism matters),
answering as vLLM does: ``{"count", "max_model_len", "tokens"}``; an image part is refused with
a 400, as a text-only model's tokenizer refuses one.

``/v1/responses`` answers as a server that implements OpenAI's Responses API itself (vLLM and
OpenAI do; the gateway relays it with ``responses: passthrough``): a ``response`` object with one
message of the fake's reply (after a reasoning item when the fake has ``reasoning``, and a
code-interpreter call when the request has that tool), or, streamed, the typed events from ``response.created`` to
``response.completed``, one ``response.output_text.delta`` per word, and no ``data: [DONE]``.
Like such a server it keeps state: each response has its own id, and a ``previous_response_id``
it never answered is a 400 ``previous_response_not_found``.
The script actions ``status:N`` and ``midstream_drop`` apply.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from bench.fake_upstream import FakeUpstream

MAX_MODEL_LEN = 4096
TEXT_ONLY = {
    "error": {
        "message": "fake-model is not a multimodal model",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def add_routes(app: web.Application, fake: FakeUpstream) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        fake.record_request(request, body)
        if _has_image(body):
            return web.json_response(TEXT_ONLY, status=400)
        count = _count(body)
        return web.json_response(
            {"count": count, "max_model_len": MAX_MODEL_LEN, "tokens": list(range(count))}
        )

    answered: list[str] = []  # the ids of the responses it made, as a stateful server keeps them

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fake.record_request(request, body)
        action = fake.script.popleft() if fake.script else "ok"
        if action.startswith("status:"):
            status = int(action.split(":", 1)[1])
            err = {"error": {"message": f"fake {status}", "type": "fake_error", "code": status}}
            return web.json_response(err, status=status)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in answered:
            err = {
                "error": {
                    "message": f"Previous response with id '{previous}' not found.",
                    "type": "invalid_request_error",
                    "param": "previous_response_id",
                    "code": "previous_response_not_found",
                }
            }
            return web.json_response(err, status=400)
        answered.append(f"resp_{uuid.uuid4().hex}")
        words = fake.settings.reply.split(" ")
        response = _response(body, " ".join(words), fake.usage(5, len(words)), answered[-1])
        response["output"][:0] = _made(body, fake.settings.reasoning)
        if not body.get("stream"):
            fake.completed += 1
            return web.json_response(response)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, event in enumerate(_events(response, words)):
            data = f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': n})}"
            await resp.write(data.encode() + b"\n\n")
            await asyncio.sleep(0)
            if action == "midstream_drop" and n == 4:
                assert request.transport is not None
                request.transport.close()
                raise ConnectionResetError("fake midstream drop")
        await resp.write_eof()
        fake.completed += 1
        return resp

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/responses", responses)


def _has_image(body: dict[str, Any]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") == "image_url"
        for message in body.get("messages") or []
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def _count(body: dict[str, Any]) -> int:
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"].split())
    total = 0
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += 3 + len(str(content or "").split())
    return total


def _response(
    body: dict[str, Any], text: str, usage: dict[str, Any], response_id: str
) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "model": body.get("model", ""),
        "output": [
            {
                "id": "msg_fake1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": details.get("cached_tokens", 0),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _made(body: dict[str, Any], reasoning: str) -> list[dict[str, Any]]:
    """The output items before the message: a reasoning item (the fake's ``reasoning`` set),
    a code-interpreter call in its container (the one named, else a new one) when the request
    has that tool. A stateful server keeps both: a later request may name them by id."""
    made: list[dict[str, Any]] = []
    if reasoning:
        summary = [{"type": "summary_text", "text": reasoning}]
        made.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": summary})
    for tool in body.get("tools") or ():
        if isinstance(tool, dict) and tool.get("type") == "code_interpreter":
            named = tool.get("container")
            container = named if isinstance(named, str) else f"cntr_{uuid.uuid4().hex}"
            made.append(
                {"id": f"ci_{uuid.uuid4().hex}", "type": "code_interpreter_call",
                 "status": "completed", "code": "print(1)", "container_id": container,
                 "outputs": None}
            )  # fmt: skip
    return made


def _events(response: dict[str, Any], words: list[str]) -> list[dict[str, Any]]:
    *made, message = response["output"]
    at = len(made)  # the message's output index
    start = {**response, "status": "in_progress", "output": [], "usage": None}
    where = {"item_id": message["id"], "output_index": at, "content_index": 0}
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for index, item in enumerate(made):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events += [
        {
            "type": "response.output_item.added",
            "output_index": at,
            "item": {**message, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **where, "part": empty_part},
    ]
    for i, word in enumerate(words):
        delta = word if i == 0 else " " + word
        events.append(
            {"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []}
        )
    text = message["content"][0]["text"]
    events += [
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": message["content"][0]},
        {"type": "response.output_item.done", "output_index": at, "item": message},
        {"type": "response.completed", "response": response},
    ]
    return events
