"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Raised anywhere on the request path (validation, placement, a downstream failure) and
turned into a response in one place, so every error a client sees has the same shape and
the openai client maps it to its exception types (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 429 RateLimitError, 5xx InternalServerError).
A 429 carries ``Retry-After`` (whole seconds), which the openai client honours when it
retries.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from aiohttp import web

from libs.protocol.http import error_body, json_error


class ApiError(Exception):
    """An error to answer with ``status``; ``type`` defaults by status class like OpenAI's."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream that has already started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"

    def response(self) -> web.Response:
        return json_error(
            self.status, self.message, type=self.type, code=self.code, param=self.param, headers=self.headers or None
        )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def no_decode_instance(detail: str = "no decode instance is available") -> ApiError:
    return ApiError(503, f"{detail}; retry later", code="no_decode_instance", type="service_unavailable")


def overloaded(message: str, retry_after_s: float, code: str = "overloaded") -> ApiError:
    """A 429: the router (or every instance) is at its limit; ``Retry-After`` says when to retry."""
    return ApiError(
        429,
        f"{message}; retry after {math.ceil(retry_after_s)} s",
        code=code,
        type="overloaded_error",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )
