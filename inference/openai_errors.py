"""Errors as OpenAI's API answers them, so an OpenAI client shows what went wrong.

``{"error": {"message", "type", "param", "code"}}``: the official SDKs raise it as their
error class for the status (``BadRequestError``, ``RateLimitError``...) with ``.param``
naming the request field at fault, in OpenAI's own notation (``messages[2].content``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web
from pydantic import ValidationError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": TYPES.get(status, "server_error"),
            "param": param,
            "code": CODES.get(status),
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


def param_of(location: Sequence[int | str]) -> str | None:
    """A field's place in the request, as OpenAI writes it: ("messages", 2, "content") is
    ``messages[2].content``; None for the request as a whole."""
    param = ""
    for part in location:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


def validation_param(exc: ValidationError) -> str | None:
    """The field of a request body's first validation error."""
    errors = exc.errors()
    return param_of(errors[0]["loc"]) if errors else None
