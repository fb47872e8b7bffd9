"""Sending an encoded ``ExportTraceServiceRequest`` to the collector, from the export thread.

OTLP/HTTP (``POST /v1/traces``, ``application/x-protobuf``, one kept-alive ``http.client``
connection) or OTLP/gRPC (the ``TraceService/Export`` unary call, the encoded request as its
bytes). A batch sent whole that the collector did not answer for within the timeout (10 s)
raises ``Unconfirmed``: it may have been received, so the exporter neither sends it again nor
counts it as dropped.
"""

from __future__ import annotations

import http.client
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit


class Sender(Protocol):
    def send(self, body: bytes) -> None: ...

    def close(self) -> None: ...


class Unconfirmed(OSError):
    """A batch was sent whole but the collector did not answer in time: it may have been
    received. It is not sent again (that would duplicate its spans), nor counted as dropped."""


class HttpSender:
    """OTLP/HTTP: ``POST {endpoint}`` with a kept-alive connection (http.client, this thread)."""

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> None:
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path or "/v1/traces"
        self._headers = {"Content-Type": "application/x-protobuf", **headers}
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def send(self, body: bytes) -> None:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        try:
            self._conn.request("POST", self._path, body, self._headers)
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        try:
            resp = self._conn.getresponse()
            resp.read()
        except TimeoutError as exc:  # sent whole, no answer in time
            self.close()
            raise Unconfirmed(f"no answer from the OTLP receiver in {self._timeout} s") from exc
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if resp.status >= 300:
            raise OSError(f"OTLP receiver answered {resp.status}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcSender:
    """OTLP/gRPC: the ``TraceService/Export`` unary call with the encoded request as its bytes."""

    METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> None:
        import grpc  # type: ignore[import-untyped]

        parts = urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
        target = f"{parts.hostname}:{parts.port or 4317}"
        self._channel = (
            grpc.insecure_channel(target)
            if parts.scheme == "http"
            else grpc.secure_channel(target, grpc.ssl_channel_credentials())
        )
        self._call = self._channel.unary_unary(self.METHOD)
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout = timeout_s
        self._rpc_error: Any = grpc.RpcError  # untyped: its code() is not known to mypy
        self._deadline_exceeded = grpc.StatusCode.DEADLINE_EXCEEDED

    def send(self, body: bytes) -> None:
        try:
            self._call(body, timeout=self._timeout, metadata=self._metadata)
        except self._rpc_error as exc:
            if exc.code() == self._deadline_exceeded:
                raise Unconfirmed(f"no answer from the OTLP receiver in {self._timeout} s") from exc
            raise

    def close(self) -> None:
        self._channel.close()


def sender_for(protocol: str, endpoint: str, headers: Mapping[str, str]) -> Sender:
    return GrpcSender(endpoint, headers) if protocol == "grpc" else HttpSender(endpoint, headers)
