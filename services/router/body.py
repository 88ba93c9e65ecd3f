"""The public API's request bodies: bounded before they are read, checked as they are parsed.

Oversized or hostile input is refused before it costs the router anything:

- **Size** (``max_body_bytes``): a ``Content-Length`` over the limit is answered 413 before a
  byte of the body is read; a chunked body is counted as it arrives and refused (413) the
  moment it passes the limit, so memory never holds more than the limit.
- **Time** (``body_timeout_s``): a body still arriving after that long is a 408, so a
  client trickling bytes cannot hold a request slot (admission.py) forever.
- **Syntax**: the body must be UTF-8 JSON (400 ``malformed_json``).
- **Depth** (``max_json_depth``): arrays and objects nested deeper than the limit are a 400
  ``json_too_deep``. Python's parser recurses, so a body nested 100,000 levels deep makes it
  raise ``RecursionError`` (which would be a 500) before any check on the result could run;
  that is caught and answered the same way.
- **Text**: every string must be valid Unicode. JSON can spell a lone UTF-16 surrogate
  (``"\\ud800"``), which Python accepts but the tokenizer (Rust) and UTF-8 cannot carry.

:func:`parse_json` is pure CPU work and runs on the router's bounded executor
(executor.py), never on the event loop: walking a large body for depth and surrogates
takes tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from services.router.errors import ApiError, bad_request

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 64


def body_too_large(limit: int, size: int | None = None) -> ApiError:
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ApiError(
        413, f"the request body is {what}; the limit is {limit} bytes", code="request_too_large", param=None
    )


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes within ``timeout_s``: a 413 :class:`ApiError`
    as soon as it is larger, a 408 when it is late."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise body_too_large(limit, declared)
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None


async def _read(request: web.Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return bytes(body)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Decode ``raw`` as JSON within ``max_depth``; a 400 :class:`ApiError` naming the problem."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep(max_depth) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="malformed_json") from None
    check_tree(value, max_depth)
    return value


def too_deep(max_depth: int) -> ApiError:
    return bad_request(f"the request body nests arrays and objects deeper than {max_depth} levels", None, "json_too_deep")


def check_tree(value: Any, max_depth: int) -> None:
    """Depth and Unicode checks over a decoded JSON value, iteratively (no recursion).

    The top-level object is depth 1. Only containers are pushed, so a flat array of a
    million numbers costs one pass over it.
    """
    if type(value) is str:
        _check_text(value)
    if type(value) not in (dict, list):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise too_deep(max_depth)
        if type(node) is dict:
            for key in node:
                _check_text(key)
            items = node.values()
        else:
            items = node
            if _SCALARS.issuperset(set(map(type, node))):
                continue  # numbers, booleans, nulls: nothing to check (a prompt's token ids, at C speed)
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif kind is str:
                _check_text(item)


_SCALARS = frozenset((int, float, bool, type(None)))


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"the request body contains a lone UTF-16 surrogate ({text[exc.start]!r} at index {exc.start} of a string); "
            "strings must be valid Unicode",
            None,
            "invalid_unicode",
        ) from None
