"""The API endpoints clients call: the OpenAI routes, models, health, readiness, metrics."""

from __future__ import annotations

from aiohttp import web

from gateway.admin import check_metrics
from gateway.dialect_routes import anthropic_errors, counted
from gateway.errors import NotFound
from gateway.keys import LIVE, METRICS, ORCHESTRATOR
from gateway.middleware import expect_continue
from gateway.protocol.anthropic_messages_output import model_object, models_page
from gateway.protocol.openai import Endpoint


def add_routes(router: web.UrlDispatcher, metrics: bool = True) -> None:
    """``metrics=False``: a worker group answers ``/metrics`` itself (``gateway.workgroup``)."""
    router.add_post("/v1/chat/completions", _chat, expect_handler=expect_continue)
    router.add_post("/v1/completions", _completions, expect_handler=expect_continue)
    router.add_post("/v1/embeddings", _embeddings, expect_handler=expect_continue)
    router.add_get("/v1/models", counted(anthropic_errors(_models, versioned=True)))
    router.add_get("/v1/models/{model:.+}", counted(anthropic_errors(_model, versioned=True)))
    router.add_get("/healthz", _healthz)
    router.add_get("/readyz", _readyz)
    if metrics:
        router.add_get("/metrics", _metrics)


async def _chat(request: web.Request) -> web.StreamResponse:
    app = request.app
    return await app[ORCHESTRATOR].handle(request, app[LIVE].current, Endpoint.CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    return await app[ORCHESTRATOR].handle(request, app[LIVE].current, Endpoint.COMPLETIONS)


async def _embeddings(request: web.Request) -> web.StreamResponse:
    app = request.app
    return await app[ORCHESTRATOR].handle(request, app[LIVE].current, Endpoint.EMBEDDINGS)


def _model_object(name: str) -> dict[str, str | int]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llm-gateway"}


async def _models(request: web.Request) -> web.Response:
    """OpenAI's model list; Anthropic's when the caller sends Anthropic's ``anthropic-version``."""
    rt = request.app[LIVE].current
    rt.authenticate(request.headers)
    if "anthropic-version" in request.headers:
        query = request.query
        page = models_page(
            rt.model_names(),
            limit=query.get("limit"),
            after_id=query.get("after_id"),
            before_id=query.get("before_id"),
            lifecycles=query.getall("lifecycle[]", []) + query.getall("lifecycle", []),
        )
        return web.json_response(page)
    data = [_model_object(name) for name in rt.model_names()]
    return web.json_response({"object": "list", "data": data})


async def _model(request: web.Request) -> web.Response:
    rt = request.app[LIVE].current
    rt.authenticate(request.headers)
    name = request.match_info["model"]
    if name not in rt.model_names():
        raise NotFound(f"The model '{name}' does not exist", code="model_not_found", param="model")
    if "anthropic-version" in request.headers:
        return web.json_response(model_object(name))
    return web.json_response(_model_object(name))


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    rt = request.app[LIVE].current
    missing = rt.not_ready()
    if missing:
        return web.json_response(
            {"status": "not ready", "backends_without_healthy_replica": missing}, status=503
        )
    return web.json_response({"status": "ready"})  # no file path: this endpoint is public


async def _metrics(request: web.Request) -> web.Response:
    check_metrics(request)
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
