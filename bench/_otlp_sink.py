"""An OTLP/HTTP trace receiver that decodes and counts what it is sent, and keeps nothing else.

bench.overhead points the traced gateway at it, so the measured cost of tracing includes the
real export (protobuf encoding, HTTP POSTs from the batch processor's thread) and the run can
show that the spans arrived: ``GET /count`` answers ``{"requests": N, "spans": S, "roots": R}``
(R: spans without a parent, one per traced request). Any other request is answered 200, so the
benchmark's readiness probe works on it too.

Run: python -m bench._otlp_sink --port P
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import uvloop
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Counts:
    requests: int = 0
    spans: int = 0
    roots: int = 0
    bad: int = 0


counts_key = web.AppKey("counts", Counts)
_EMPTY_RESPONSE = ExportTraceServiceResponse().SerializeToString()


async def receive(request: web.Request) -> web.Response:
    counts = request.app[counts_key]
    message = ExportTraceServiceRequest()
    try:
        message.ParseFromString(await request.read())
    except Exception:  # a body that is not OTLP protobuf: count it, answer 400
        counts.bad += 1
        return web.Response(status=400)
    counts.requests += 1
    for resource_spans in message.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                counts.spans += 1
                counts.roots += not span.parent_span_id
    return web.Response(body=_EMPTY_RESPONSE, content_type="application/x-protobuf")


async def count(request: web.Request) -> web.Response:
    return web.json_response(request.app[counts_key].__dict__)


async def anything(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({})


def build_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[counts_key] = Counts()
    app.router.add_post("/v1/traces", receive)
    app.router.add_get("/count", count)
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._otlp_sink")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(
        build_app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
