"""Errors on the wire: the stable codes of the HTTP API, their statuses, and the
exception each maps back to.

Errors are JSON ``{"error": {"code": ..., "message": ...}}`` with a stable
``code`` and the HTTP status of ``ERRORS``; the same table maps a response
back to the ``KVStoreError`` the embedded store would have raised.
"""

from __future__ import annotations

import enum
from typing import Any

from kvstore.errors import (
    BadRequest,
    ConfigError,
    CorruptBlock,
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierUnavailable,
    UnknownNamespace,
)


class ErrorCode(enum.Enum):
    """Stable error codes of the HTTP API (the ``code`` field)."""

    BAD_REQUEST = "bad_request"
    MALFORMED_BODY = "malformed_body"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    UNKNOWN_NAMESPACE = "unknown_namespace"
    UNKNOWN_LEASE = "unknown_lease"
    LAYOUT_MISMATCH = "layout_mismatch"
    CORRUPT_BLOCK = "corrupt_block"
    REQUEST_TOO_LARGE = "request_too_large"
    LENGTH_REQUIRED = "length_required"
    REQUEST_TIMEOUT = "request_timeout"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


# code -> (HTTP status, exception a client raises for it)
ERRORS: dict[ErrorCode, tuple[int, type[KVStoreError]]] = {
    ErrorCode.BAD_REQUEST: (400, BadRequest),
    ErrorCode.MALFORMED_BODY: (400, KVStoreError),
    ErrorCode.UNAUTHORIZED: (401, KVStoreError),
    ErrorCode.NOT_FOUND: (404, KVStoreError),
    ErrorCode.UNKNOWN_NAMESPACE: (404, UnknownNamespace),
    ErrorCode.UNKNOWN_LEASE: (404, KVStoreError),
    ErrorCode.LAYOUT_MISMATCH: (422, LayoutMismatch),
    ErrorCode.CORRUPT_BLOCK: (422, CorruptBlock),
    ErrorCode.REQUEST_TOO_LARGE: (413, RequestTooLarge),
    ErrorCode.LENGTH_REQUIRED: (411, KVStoreError),
    # The client sent too slowly; to it, as to a daemon too slow, the call degrades.
    ErrorCode.REQUEST_TIMEOUT: (408, TierUnavailable),
    ErrorCode.UNAVAILABLE: (503, TierUnavailable),
    ErrorCode.INTERNAL: (500, KVStoreError),
}


class WireError(KVStoreError):
    """A request or response that breaks the wire format; carries its error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_code_of(error: KVStoreError) -> ErrorCode:
    """The wire code for an exception raised while serving a request."""
    if isinstance(error, WireError):
        return error.code
    for exception_type, code in (
        (UnknownNamespace, ErrorCode.UNKNOWN_NAMESPACE),
        (LayoutMismatch, ErrorCode.LAYOUT_MISMATCH),
        (CorruptBlock, ErrorCode.CORRUPT_BLOCK),
        (RequestTooLarge, ErrorCode.REQUEST_TOO_LARGE),
        (ConfigError, ErrorCode.BAD_REQUEST),
        (TierUnavailable, ErrorCode.UNAVAILABLE),
    ):
        if isinstance(error, exception_type):
            return code
    return ErrorCode.INTERNAL


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"error": {"code": code.value, "message": message}}


def exception_from_body(status: int, body: Any) -> KVStoreError:
    """The exception an error response stands for (unknown shapes become ``KVStoreError``)."""
    try:
        code = ErrorCode(body["error"]["code"])
        message = str(body["error"]["message"])
    except (KeyError, TypeError, ValueError):
        return KVStoreError(f"HTTP {status} without a kvstore error body")
    exception_type = ERRORS[code][1]
    if exception_type is TierUnavailable:
        return TierUnavailable("daemon", message)
    return exception_type(f"{code.value}: {message}")
