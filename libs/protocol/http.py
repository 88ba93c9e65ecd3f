"""aiohttp helpers: read a typed message from a request, answer with one, and JSON errors.

Internal endpoints take and return ``application/msgpack``. Anything wrong with a request
body (content type, size, syntax, type, version, fields) is a 400 whose JSON body names the
problem, never a 500. Errors use the OpenAI shape the router also serves publicly,
``{"error": {"message", "type", "param", "code"}}``: ``code`` is the
:class:`~libs.protocol.errors.ErrorCode` and ``param`` the offending field's path.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, TypeVar

import aiohttp
from aiohttp import web

from libs.protocol.errors import ErrorCode, ProtocolError
from libs.protocol.limits import DEFAULT_LIMITS, Limits
from libs.protocol.message import Message, decode, encode

MSGPACK_CONTENT_TYPE = "application/msgpack"
# The header carrying the services' shared internal token (services/common/app.py).
INTERNAL_TOKEN_HEADER = "X-Tidepool-Internal-Token"


def internal_headers(token: str | None) -> dict[str, str]:
    """The headers a service's calls to another service carry: the token when there is one."""
    return {INTERNAL_TOKEN_HEADER: token} if token else {}

M = TypeVar("M", bound=Message)


def error_body(message: str, *, type: str, code: str | int | None = None, param: str | None = None) -> dict[str, Any]:
    """The JSON error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_error(
    status: int,
    message: str,
    *,
    type: str | None = None,
    code: str | int | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """A JSON error response; ``type`` defaults by status class (4xx client, 5xx server)."""
    if type is None:
        type = "server_error" if status >= 500 else "invalid_request_error"
    return web.Response(
        status=status,
        text=json.dumps(error_body(message, type=type, code=code, param=param)),
        content_type="application/json",
        headers=headers,
    )


def bad_request(exc: ProtocolError) -> web.HTTPBadRequest:
    """The 400 to raise for a request that failed to decode."""
    body = error_body(str(exc), type="invalid_request_error", code=exc.code.value, param=exc.field)
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


def check_content_type(content_type: str, *, status: int | None = None) -> None:
    """Raise ``bad_content_type`` unless ``content_type`` is ``application/msgpack``."""
    if content_type != MSGPACK_CONTENT_TYPE:
        where = f" (HTTP {status})" if status is not None else ""
        raise ProtocolError(
            ErrorCode.BAD_CONTENT_TYPE, f"expected Content-Type {MSGPACK_CONTENT_TYPE}, got {content_type or 'none'}{where}"
        )


async def read_body(content: aiohttp.StreamReader, declared_length: int | None, limit: int) -> bytes:
    """Read a whole body of at most ``limit`` bytes, refusing early when it is larger.

    Not ``request.read()``: that is bounded by the app's ``client_max_size`` and answers 413;
    here the protocol's limit applies and the answer is a 400 naming it.
    """
    if declared_length is not None and declared_length > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {declared_length} bytes exceeds {limit}")
    body = bytearray()
    async for chunk in content.iter_any():
        body += chunk
        if len(body) > limit:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"body exceeds {limit} bytes")
    return bytes(body)


async def read_message(request: web.Request, expected: type[M], *, limits: Limits = DEFAULT_LIMITS) -> M:
    """Decode the request body as an ``expected`` message, or raise a JSON 400 naming why."""
    try:
        check_content_type(request.content_type)
        body = await read_body(request.content, request.content_length, limits.max_body_bytes)
        return decode(body, expected, limits=limits)
    except ProtocolError as exc:
        raise bad_request(exc) from None


async def read_response(
    response: aiohttp.ClientResponse, expected: type[M], *, limits: Limits = DEFAULT_LIMITS
) -> M:
    """Decode a peer's msgpack response body as an ``expected`` message.

    Raises :class:`ProtocolError` (``bad_content_type`` names the HTTP status, so a peer's
    JSON error is recognisable); check ``response.status`` first to handle errors yourself.
    """
    check_content_type(response.content_type, status=response.status)
    body = await read_body(response.content, response.content_length, limits.max_body_bytes)
    return decode(body, expected, limits=limits)


def msgpack_response(message: Message, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """An ``application/msgpack`` response carrying ``message``."""
    return web.Response(status=status, body=encode(message), content_type=MSGPACK_CONTENT_TYPE, headers=headers)
