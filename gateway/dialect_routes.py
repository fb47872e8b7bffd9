"""The endpoints of the other client APIs: OpenAI's Responses API and Anthropic's Messages API.

Each handler authenticates, reads the body once, decides between translating the request onto
the chat path (every backend, every stage) and relaying it untranslated (a backend that serves
the API itself: ``responses: passthrough``, or a ``kind: anthropic`` backend for Messages; not
for tiered aliases, whose tiers are chosen on chat requests), then hands one ``Dialect`` to the
orchestrator. Stored responses (``GET``/``DELETE /v1/responses/{id}``, ``input_items``) are read
in the caller's tenant only. A passthrough's upstream keeps every tenant's responses under the
gateway's one key: a ``previous_response_id`` is relayed only when the store records the
response as the caller's (``ResponsesCall.ended`` records it), and is otherwise answered as an
unknown id is; a ``conversation`` or an ``item_reference`` input, whose owner the gateway
cannot tell, is refused (400). Messages errors leave in Anthropic's format and statuses.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from gateway.call import read_body
from gateway.conversations import StoredResponse, StoreUnavailable
from gateway.dialects import MessagesCall, ResponsesCall
from gateway.errors import BadRequest, GatewayError, NotFound, Unavailable, UpstreamError
from gateway.keys import LIVE, ORCHESTRATOR
from gateway.middleware import expect_continue
from gateway.orchestrator import LABELS_KEY, UNKNOWN_MODEL
from gateway.protocol import anthropic_messages_output as messages_out
from gateway.protocol import strict_json, token_count, upstream_json
from gateway.protocol.anthropic_messages import MessagesRequest, read_messages_request
from gateway.protocol.openai import Endpoint, ParsedRequest
from gateway.protocol.responses import read_responses_request, relayed_request
from gateway.runtime import Destination, Runtime
from gateway.upstream.attempt import key_refused
from gateway.upstream.client import read_capped, rejected_key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(router: web.UrlDispatcher) -> None:
    post_r = counted(_create_response)
    router.add_post("/v1/responses", post_r, expect_handler=expect_continue)
    router.add_get("/v1/responses/{id}", counted(_get_response))
    router.add_delete("/v1/responses/{id}", counted(_delete_response))
    router.add_get("/v1/responses/{id}/input_items", counted(_input_items))
    post_m = counted(anthropic_errors(_messages))
    router.add_post("/v1/messages", post_m, expect_handler=expect_continue)
    count = counted(anthropic_errors(_count_tokens))
    router.add_post("/v1/messages/count_tokens", count, expect_handler=expect_continue)


def counted(handler: Handler) -> Handler:
    """An API route counted in ``llm_gateway_requests_total`` however it ends (a 401, a body
    that is no JSON, a 413): labelled ``unknown`` until the request names a model the policy
    serves (``_read_model``)."""

    async def labelled(request: web.Request) -> web.StreamResponse:
        request[LABELS_KEY] = (UNKNOWN_MODEL, "", "")
        return await handler(request)

    return labelled


def _read_model(request: web.Request, rt: Runtime, raw: bytes) -> dict[str, Any]:
    """The body, checked to be an object with a model; the request is labelled with the model
    so the metrics count it however it ends (a missing previous response, a 400), when it is
    one the policy serves: a caller's arbitrary name never becomes a label."""
    body = _json_object(raw)
    model = body["model"]
    request[LABELS_KEY] = (model if model in rt.policy.models else UNKNOWN_MODEL, "", "")
    return body


def _json_object(raw: bytes) -> dict[str, Any]:
    body = strict_json.loads(raw)  # a 400 for anything but strict UTF-8 JSON
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, (bool, type(None))):
        raise BadRequest("'stream' must be a boolean", param="stream")
    return body


def _passthrough(
    rt: Runtime, endpoint: Endpoint, raw: bytes, body: dict[str, Any]
) -> ParsedRequest | None:
    """The client's own request, when the model's primary backend serves ``endpoint`` itself."""
    model = body["model"]
    if not rt.passthrough(model, endpoint):
        return None
    return ParsedRequest(endpoint, raw, body, model, bool(body.get("stream")), None)


# --- the Responses API ------------------------------------------------------------------------


async def _create_response(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()  # the request's arrival: its span and TTFT start here
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    raw = await read_body(request, rt.policy.server)
    body = _read_model(request, rt, raw)
    passthrough = _passthrough(rt, Endpoint.RESPONSES, raw, body)
    if passthrough is not None:  # the upstream checks the request and keeps its state
        previous = body.get("previous_response_id")
        if previous is not None:  # the upstream would find any tenant's: it must be the caller's
            if not isinstance(previous, str) or not previous:
                raise BadRequest(
                    "'previous_response_id' must be a string", param="previous_response_id"
                )
            await _stored(rt, tenant, previous, "previous_response_id", relayed=True)
        _no_upstream_state(body)
        for name, param in _named_objects(body):
            await _owned(rt, tenant, name, param)
        stored = body.get("store") is not False
        request_ = relayed_request(body["model"], passthrough.stream, stored)
        call = ResponsesCall(request_, tenant, rt.responses, passthrough=passthrough)
        return await request.app[ORCHESTRATOR].handle_dialect(request, rt, tenant, call, started)
    parsed = read_responses_request(body)
    history: list[dict[str, Any]] = []
    if parsed.previous_response_id is not None:
        previous = await _stored(rt, tenant, parsed.previous_response_id, "previous_response_id")
        history = previous.messages
    call = ResponsesCall(parsed, tenant, rt.responses, history)
    return await request.app[ORCHESTRATOR].handle_dialect(request, rt, tenant, call, started)


def _no_upstream_state(body: dict[str, Any]) -> None:
    """Refuse what would name upstream state the gateway cannot tell the owner of: a
    conversation, or an input item by reference (the upstream holds every tenant's items under
    the gateway's one key). A ``previous_response_id`` is checked against the store instead."""
    if body.get("conversation") is not None:
        raise BadRequest(
            "'conversation' is not supported through this gateway; "
            "continue with 'previous_response_id'",
            param="conversation",
        )
    items = body.get("input")
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, dict) and _by_reference(item):
                raise BadRequest(
                    "input items by reference are not supported through this gateway; "
                    "send the item itself or continue with 'previous_response_id'",
                    param=f"input[{index}]",
                )


def _named_objects(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The objects of other responses a passthrough request names by id, each with where:
    reasoning items sent back by id alone (no ``encrypted_content``: the upstream reads them
    from its store) and code-interpreter containers. Each must be one the caller's own
    responses made (``ResponsesCall.owned``)."""
    named: list[tuple[str, str]] = []
    items = body.get("input")
    for index, item in enumerate(items if isinstance(items, list) else ()):
        if _stored_reasoning(item):
            named.append((item["id"], f"input[{index}]"))
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") == "code_interpreter":
            container = tool.get("container")  # an id, or an object asking for a new one
            if isinstance(container, str):
                named.append((container, f"tools[{index}].container"))
    return named


def _stored_reasoning(item: Any) -> bool:
    """A reasoning item sent back by its id alone, for the upstream to read from its store."""
    return (
        isinstance(item, dict)
        and item.get("type") == "reasoning"
        and not item.get("encrypted_content")
        and isinstance(item.get("id"), str)
    )


async def _owned(rt: Runtime, tenant: str, name: str, param: str) -> None:
    """A 400 unless a response of the caller's made ``name`` (another tenant's is unknown)."""
    try:
        record = await rt.responses.get(tenant, name)
    except StoreUnavailable as exc:
        raise _store_unavailable(rt) from exc
    if record is None or not record.relayed:
        raise BadRequest(
            f"'{name[:64]}' was not made by a response of this caller through this gateway; "
            "send the item itself (reasoning with its encrypted_content) or continue with "
            "'previous_response_id'",
            param=param,
        )


def _by_reference(item: dict[str, Any]) -> bool:
    """An item reference: typed so, or (its ``type`` being optional) an item with no type that
    is no message (a message may leave out its type, never its ``role``)."""
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "role" not in item)


async def _stored(
    rt: Runtime, tenant: str, response_id: str, param: str, *, relayed: bool = False
) -> StoredResponse:
    """The tenant's stored response (another tenant's is not found, like an unknown id), or
    with ``relayed`` the record that a response kept upstream is the tenant's (each kind is not
    found where the other is asked for: the gateway neither shows nor deletes what it relayed).
    As a ``previous_response_id`` a missing one is a 400 ``previous_response_not_found``, as
    OpenAI answers (clients reset their chain on that code); by its path, a 404."""
    try:
        record = await rt.responses.get(tenant, response_id)
    except StoreUnavailable as exc:
        raise _store_unavailable(rt) from exc
    if record is not None and record.relayed != relayed:
        record = None
    if record is None and param == "previous_response_id":
        raise BadRequest(
            f"Previous response with id '{response_id}' not found.",
            param=param, code="previous_response_not_found",
        )  # fmt: skip
    if record is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param=param)
    return record


def _store_unavailable(rt: Runtime) -> Unavailable:
    return Unavailable(
        "the response store is unavailable", code="store_unavailable",
        headers={"Retry-After": rt.retry_after},
    )  # fmt: skip


async def _get_response(request: web.Request) -> web.Response:
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    record = await _stored(rt, tenant, request.match_info["id"], "response_id")
    return web.json_response(record.response)


async def _delete_response(request: web.Request) -> web.Response:
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    response_id = request.match_info["id"]
    await _stored(rt, tenant, response_id, "response_id")  # not a relayed response's record
    try:
        deleted = await rt.responses.delete(tenant, response_id)
    except StoreUnavailable as exc:
        raise _store_unavailable(rt) from exc
    if not deleted:
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def _input_items(request: web.Request) -> web.Response:
    """A page of the response's input items: ``limit`` (1-100, 20), ``order`` (desc), ``after``."""
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    record = await _stored(rt, tenant, request.match_info["id"], "response_id")
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("'limit' must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be asc or desc", param="order")
    items = record.input_items if order == "asc" else record.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise BadRequest(f"no input item with id '{after}'", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


# --- Anthropic's Messages API ------------------------------------------------------------------


def anthropic_errors(handler: Handler, versioned: bool = False) -> Handler:
    """Errors in Anthropic's format, ``{"type": "error", "error": {"type", "message"}}``; with
    ``versioned``, only for a caller that sends ``anthropic-version`` (a route both APIs share)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        if versioned and "anthropic-version" not in request.headers:
            return await handler(request)
        try:
            return await handler(request)
        except GatewayError as exc:
            status = messages_out.error_status(exc.status)
            body = messages_out.error_body(status, exc.message)
            return web.json_response(body, status=status, headers=exc.headers)

    return wrapped


async def _messages(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()  # the request's arrival: its span and TTFT start here
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    raw = await read_body(request, rt.policy.server)
    body = _read_model(request, rt, raw)
    passthrough = _passthrough(rt, Endpoint.MESSAGES, raw, body)
    if passthrough is not None:  # Anthropic itself checks the request
        untranslated = MessagesRequest(body["model"], passthrough.stream, {}, ())
        call = MessagesCall(untranslated, passthrough)
    else:
        call = MessagesCall(read_messages_request(body))
    return await request.app[ORCHESTRATOR].handle_dialect(request, rt, tenant, call, started)


async def _count_tokens(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``, Anthropic's own ``count_tokens``, else (an OpenAI-compatible API,
    or a vLLM-kind server without ``/tokenize``) the documented estimate. A refusal of the
    request (a 4xx) comes back as ``/v1/messages`` relays one, with the backend's message."""
    rt = request.app[LIVE].current
    tenant = rt.authenticate(request.headers)
    body = _read_model(request, rt, await read_body(request, rt.policy.server))
    target = rt.targets(body["model"])[0]
    # A count is a request to the backend too: the tenant's request limits hold for it.
    surface = rt.surface_for(tenant, request.headers.get(rt.surface_header)).name
    limits = request.app[ORCHESTRATOR].limits
    admission = await limits.admit_request(rt, tenant, surface)
    try:
        return await _counted(rt, target, body)
    finally:
        rt.limiter.finish(admission, None)


async def _counted(rt: Runtime, target: Destination, body: dict[str, Any]) -> web.Response:
    pool = target.pool
    replicas = pool.available()
    if not replicas:
        raise Unavailable(
            f"no healthy replica can serve model '{body['model']}'",
            code="no_healthy_replica", headers={"Retry-After": rt.retry_after},
        )  # fmt: skip
    base = replicas[0].base_url
    timeout = aiohttp.ClientTimeout(total=target.timeouts.first_byte_s)
    limit = rt.policy.server.max_response_bytes
    # Never a redirect (it would carry the prompt, and a provider's key, elsewhere); the answer
    # read under server.max_response_bytes, as every upstream answer is.
    post = functools.partial(pool.session.post, timeout=timeout, allow_redirects=False)
    try:
        if target.provider is not None and rt.native(target, Endpoint.MESSAGES):
            sent = {**body, "model": target.upstream_model}
            headers = {**target.provider.headers, "Content-Type": "application/json"}
            async with post(f"{base}/messages/count_tokens", json=sent, headers=headers) as r:
                _check_key(target, replicas[0].name, r.status)
                return _relayed_count(r.status, await read_capped(r, limit))
        request = read_messages_request(body, count_only=True)
        chat = request.chat
        if pool.settings.kind != "vllm":
            return web.json_response({"input_tokens": token_count.estimate(chat)})
        sent = token_count.tokenize_body(chat, target.upstream_model, request.prefill)
        url = token_count.tokenize_url(base)
        async with post(url, json=sent, headers=pool.auth_headers()) as r:
            _check_key(target, replicas[0].name, r.status)
            if r.status == 404:  # a server without vLLM's tokenizer endpoint
                return web.json_response({"input_tokens": token_count.estimate(chat)})
            answer = await read_capped(r, limit)
            if 400 <= r.status < 500:  # the request refused (an image to a text-only model)
                status, refused = messages_out.from_openai_error(r.status, answer)
                return web.Response(status=status, body=refused, content_type="application/json")
            count = token_count.read_count(upstream_json.loads(answer)) if r.status == 200 else None
            if count is None:
                raise UpstreamError(
                    f"the backend's tokenizer answered {r.status}", code="bad_gateway"
                )
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise UpstreamError(
            "the backend's token count did not come back", code="bad_gateway"
        ) from exc
    return web.json_response({"input_tokens": count})


def _relayed_count(status: int, answer: bytes) -> web.Response:
    """Anthropic's count as it came: its JSON answer, or its JSON refusal (a 4xx); a 4xx that
    is not JSON (a proxy's page) as Anthropic's error shape, anything else a 502."""
    try:
        data = upstream_json.loads(answer)
    except ValueError:
        data = None
    if isinstance(data, dict) and (status == 200 or 400 <= status < 500):
        return web.Response(status=status, body=answer, content_type="application/json")
    if 400 <= status < 500:
        message = f"the backend refused the token count ({status})"
        return web.json_response(messages_out.error_body(status, message), status=status)
    raise UpstreamError(f"the backend's token count answered {status}", code="bad_gateway")


def _check_key(target: Destination, replica: str, status: int) -> None:
    """A backend refusing the gateway's own key is answered as ``/v1/messages`` answers it (a
    502, the operator told), never relayed: its 401 would tell the caller its key is wrong."""
    if status in (401, 403):
        raise key_refused(target.pool.name, rejected_key(replica, status))
