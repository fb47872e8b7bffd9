"""The floor: the least an aiohttp + uvloop proxy can do (forward the body, relay the stream).

Any Python gateway on this stack pays at least this much per request; bench.overhead runs it
beside llm-gateway so the gateway's own cost reads as a ratio to it.
Run: python -m bench._bare_proxy --upstream http://127.0.0.1:PORT --port P
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

session_key = web.AppKey("session", aiohttp.ClientSession)
upstream_key = web.AppKey("upstream", str)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[upstream_key] + request.path
    headers = {"Content-Type": "application/json"}
    async with request.app[session_key].post(url, data=body, headers=headers) as upstream:
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            payload = await upstream.read()
            return web.Response(
                body=payload, status=upstream.status, content_type="application/json"
            )
        response = web.StreamResponse(status=upstream.status)
        response.content_type = "text/event-stream"
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def create_app(upstream: str) -> web.Application:
    app = web.Application()
    app[upstream_key] = upstream.rstrip("/")

    async def client_session(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            app[session_key] = session
            yield

    app.cleanup_ctx.append(client_session)
    app.router.add_post("/v1/chat/completions", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--upstream", required=True, help="upstream origin, e.g. http://127.0.0.1:9000"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(
        create_app(args.upstream),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
