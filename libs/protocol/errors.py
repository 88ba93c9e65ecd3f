"""Protocol errors: one exception type carrying a machine-readable code and the field path.

Every decoding failure is a :class:`ProtocolError`, so an HTTP handler needs one ``except``
to turn bad input into a 400. The ``code`` says what went wrong and ``field`` where (a dotted
path such as ``sampling.top_k`` or ``first_logprobs[2].top_ids[0]``), so the error a peer sees
names the problem without anyone reading server logs.

:class:`TruncatedStreamError` is a subclass because "the peer died mid-stream" calls for a
different reaction (retry elsewhere, recompute) than "the peer sent garbage" (a bug).
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """What went wrong; the ``code`` of the HTTP error body."""

    MALFORMED = "malformed"  # not msgpack, or not the shape of a message
    TOO_LARGE = "too_large"  # a body, string, binary, array, map or nesting over its limit
    EXT_NOT_ALLOWED = "ext_not_allowed"  # msgpack ext types (incl. timestamps) are refused
    UNKNOWN_TYPE = "unknown_type"
    UNEXPECTED_TYPE = "unexpected_type"  # a known message, but not the one this endpoint takes
    WRONG_VERSION = "wrong_version"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    WRONG_TYPE = "wrong_type"
    INVALID_VALUE = "invalid_value"  # right type, value out of range
    BAD_CONTENT_TYPE = "bad_content_type"
    TRUNCATED = "truncated"  # a stream or body that ended inside a message


class ProtocolError(ValueError):
    """A message could not be decoded (or encoded): ``code`` what, ``field`` where."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        self.code = code
        self.message = message
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class TruncatedStreamError(ProtocolError):
    """A stream ended inside a message, or the connection broke before the body ended."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TRUNCATED, message)
