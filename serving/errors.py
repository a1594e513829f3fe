"""One error tree and one mapping to OpenAI-shaped HTTP error bodies.

Every client mistake becomes ``{"error": {"message", "type", "param", "code"}}`` with the right 4xx;
server faults become 5xx carrying the request id, never a stack trace.

    GatewayError
    +-- InvalidRequest        400  invalid_request_error
    |   +-- BodyTooLarge      413
    +-- AuthenticationError   401  authentication_error
    +-- NotFound              404  (unknown model: code model_not_found)
    +-- MethodNotAllowed      405
    +-- RateLimited           429  rate_limit_exceeded (Retry-After, x-ratelimit-* headers)
    +-- Unavailable           503  no replica in time / queue full (Retry-After)
    +-- UpstreamError         502  replicas failed before answering, after retries
    +-- InternalError         500
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

__all__ = [
    "unavailable",
    "AuthenticationError",
    "BodyTooLarge",
    "GatewayError",
    "InternalError",
    "InvalidRequest",
    "MethodNotAllowed",
    "NotFound",
    "RateLimited",
    "Unavailable",
    "UpstreamError",
    "error_body",
    "sse_error_event",
    "to_response",
]


class GatewayError(Exception):
    """Base of every error the gateway raises; carries what the HTTP answer needs."""

    status: int = 500
    type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class InvalidRequest(GatewayError):
    status, type = 400, "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    status = 413


class AuthenticationError(GatewayError):
    status, type = 401, "authentication_error"


class NotFound(GatewayError):
    status, type = 404, "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status, type = 405, "invalid_request_error"


class RateLimited(GatewayError):
    status, type = 429, "rate_limit_exceeded"


class Unavailable(GatewayError):
    status, type = 503, "service_unavailable"


def unavailable(message: str, retry_after: int = 1) -> Unavailable:
    """A 503 that tells the client when to retry."""
    return Unavailable(message, headers={"retry-after": str(retry_after)})


class UpstreamError(GatewayError):
    status, type = 502, "upstream_error"


class InternalError(GatewayError):
    status, type = 500, "server_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def to_response(exc: BaseException, request_id: str) -> ErrorResponse:
    """Map any exception to the one error shape. Unknown exceptions become a bare 500."""
    if isinstance(exc, GatewayError):
        message = exc.message
        if exc.status >= 500:
            message = f"{message} (request id {request_id})"
        return ErrorResponse(exc.status, error_body(message, exc.type, exc.param, exc.code), dict(exc.headers))
    return ErrorResponse(
        500,
        error_body(f"internal error (request id {request_id})", "server_error", None, None),
    )


def sse_error_event(exc: BaseException, request_id: str) -> bytes:
    """The final SSE event of a stream that failed after its first byte."""
    resp = to_response(exc, request_id)
    return b"data: " + resp.body + b"\n\ndata: [DONE]\n\n"
