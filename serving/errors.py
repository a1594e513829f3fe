"""One error tree and one mapping to OpenAI-shaped HTTP error bodies.

Every client mistake becomes ``{"error": {"message", "type", "param", "code"}}`` with the right 4xx;
server faults become 5xx carrying the request id, never a stack trace. The Anthropic routes
(``/v1/messages``) render the same errors in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, the type chosen by status
(:data:`ANTHROPIC_TYPES`); a shape is picked per route, the tree stays one.

    GatewayError
    +-- InvalidRequest        400  invalid_request_error
    |   +-- BodyTooLarge      413
    +-- AuthenticationError   401  authentication_error
    +-- PermissionDenied      403  permission_error
    +-- NotFound              404  (unknown model: code model_not_found)
    +-- MethodNotAllowed      405
    +-- RateLimited           429  rate_limit_exceeded (Retry-After, x-ratelimit-* headers)
    +-- Unavailable           503  no replica in time / queue full (Retry-After)
    +-- UpstreamError         502  replicas failed before answering, after retries
    +-- InternalError         500
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

ErrorShape = Literal["openai", "responses", "anthropic"]
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

__all__ = [
    "ANTHROPIC_TYPES",
    "ErrorShape",
    "PermissionDenied",
    "anthropic_error_body",
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


class PermissionDenied(GatewayError):
    status, type = 403, "permission_error"


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


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error body for ``status`` (5xx other than overload: ``api_error``)."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    return msgspec.json.encode(
        {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, default), "message": message}}
    )


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def to_response(exc: BaseException, request_id: str, shape: ErrorShape = "openai") -> ErrorResponse:
    """Map any exception to the route's error shape. Unknown exceptions become a bare 500."""
    if isinstance(exc, GatewayError):
        message = exc.message
        if exc.status >= 500:
            message = f"{message} (request id {request_id})"
        if shape == "anthropic":
            return ErrorResponse(exc.status, anthropic_error_body(exc.status, message), dict(exc.headers))
        return ErrorResponse(exc.status, error_body(message, exc.type, exc.param, exc.code), dict(exc.headers))
    message = f"internal error (request id {request_id})"
    if shape == "anthropic":
        return ErrorResponse(500, anthropic_error_body(500, message))
    return ErrorResponse(500, error_body(message, "server_error", None, None))


def sse_error_event(
    exc: BaseException, request_id: str, shape: ErrorShape = "openai", sequence_number: int = 0
) -> bytes:
    """The final SSE event of a stream that failed after its first byte: OpenAI's chat streams
    end with the error body and ``[DONE]``; Responses and Anthropic streams with an ``error`` event
    in their own format (a Responses event numbered ``sequence_number``, the one after the last
    event the client got)."""
    resp = to_response(exc, request_id, shape)
    if shape == "anthropic":
        return b"event: error\ndata: " + resp.body + b"\n\n"
    if shape == "responses":
        err = msgspec.json.decode(resp.body)["error"]
        event = {"type": "error", "code": err["code"] or err["type"], "message": err["message"], "param": None}
        event["sequence_number"] = sequence_number
        return b"event: error\ndata: " + msgspec.json.encode(event) + b"\n\n"
    return b"data: " + resp.body + b"\n\ndata: [DONE]\n\n"
