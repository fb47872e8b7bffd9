"""The gateway's errors: one hierarchy, each with an HTTP status and an OpenAI error type.

| class              | status | type                  | when                                        |
|--------------------|--------|-----------------------|---------------------------------------------|
| BadRequest         | 400    | invalid_request_error | malformed JSON, missing or mistyped fields  |
| Unauthorized       | 401    | authentication_error  | missing or unknown API key                  |
| Forbidden          | 403    | permission_error      | admin API off (no admin token, public bind)  |
| NotFound           | 404    | not_found_error       | unknown model or route                      |
| PayloadTooLarge    | 413    | invalid_request_error | body over server.max_body_bytes             |
| RateLimited        | 429    | rate_limit_exceeded   | a tenant's rate limit, or every upstream's  |
| QuotaExceeded      | 429    | insufficient_quota    | a tenant's spend budget is spent            |
| UpstreamError      | 502    | upstream_error        | connect error or 5xx after retries          |
| Unavailable        | 503    | service_unavailable   | no healthy replica (with Retry-After)       |
| UpstreamTimeout    | 504    | timeout_error         | the upstream did not answer in time         |
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def named_code(self) -> str:
        """The error's code, else its status's (a string, as in OpenAI's error objects): an
        error event ending a stream always says which failure ended it."""
        return self.code or _STATUS_CODES.get(self.status, "bad_gateway")


_STATUS_CODES = {502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}


def error_body(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(message: str, type_: str, code: str | int | None = None) -> bytes:
    return json.dumps(error_body(message, type_, code)).encode()


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        # RFC 9110: a 401 names the scheme it wants
        super().__init__(message, code=code, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"


class QuotaExceeded(GatewayError):
    status = 429
    type = "insufficient_quota"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"


class Unavailable(GatewayError):
    status = 503
    type = "service_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout_error"


# The message a stopping server cancels its unfinished requests with (``GuardedRunner.drain``):
# a request cut so tells its client (a 503, or an error event ending its stream) instead of
# losing its connection without a word.
STOPPING = "llm-gateway: the server is stopping"


def stopping(exc: BaseException) -> bool:
    return exc.args == (STOPPING,)
