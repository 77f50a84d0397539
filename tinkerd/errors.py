"""The one error vocabulary shared by all services.

Services raise `UserError` / `NotFoundError` for the caller's mistakes; the gRPC boundary maps
them to status codes, and the gateway maps status codes to Tinker's error categories
("user" / "server" / "unknown"). This file holds the only mapping table.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class UserError(ServiceError):
    """Bad input: the request can never succeed as sent."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class StateDirError(UserError):
    """A --state-dir that cannot serve as given; the message says what to change."""


class NotFoundError(UserError):
    code = grpc.StatusCode.NOT_FOUND


class UnavailableError(ServiceError):
    """Retryable: the service is not ready or is overloaded."""
    code = grpc.StatusCode.UNAVAILABLE


class LostWorkError(ServiceError):
    """The trainer restarted and a model resumed from an earlier state: the caller must know."""
    code = grpc.StatusCode.ABORTED


_USER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
}
_SERVER_CODES = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
}


def category_for(code: grpc.StatusCode) -> str:
    """Tinker's RequestErrorCategory for a gRPC status code."""
    if code in _USER_CODES:
        return "user"
    if code in _SERVER_CODES:
        return "server"
    return "unknown"


def category_for_http(status: int) -> str:
    """Tinker's category for an HTTP error status: waiting (408, 429) and 5xx are the server's."""
    if status in (408, 429) or status >= 500:
        return "server"
    return "user" if 400 <= status < 500 else "unknown"
