"""aiohttp helpers: read a typed message from a request, answer with one, and JSON errors.

Errors on internal endpoints use the OpenAI error shape the router also serves publicly,
``{"error": {"message", "type", "param", "code"}}``, so a tool or a peer sees one error
format whichever service it talks to.
"""

from __future__ import annotations

import json
from typing import Mapping

from aiohttp import web


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
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.Response(
        status=status,
        text=json.dumps(body),
        content_type="application/json",
        headers=headers,
    )
