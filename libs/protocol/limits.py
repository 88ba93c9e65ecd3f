"""Decode limits: how big a message peers may send before it is refused.

Limits are enforced twice. msgpack's own ``max_*_len`` options refuse an oversized string,
binary, array or map while unpacking, before it is allocated; the schema check after
unpacking validates lengths and nesting again, so a limit also holds for values that
reached the decoder some other way (and when msgpack's counting differs, e.g. bytes vs
characters). Whole bodies (and, in a stream, each message) are bounded by
``max_body_bytes`` before msgpack sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.protocol.errors import ErrorCode, ProtocolError

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Size limits for decoding; the defaults fit the largest legitimate internal message.

    Attributes:
        max_body_bytes: a whole request/response body, or one message of a stream.
        max_str_len: one string, in bytes on the wire (characters after decoding).
        max_bin_len: one binary field.
        max_array_len: items in one array (a 1M-token prompt fits).
        max_map_len: entries in one map (messages, timings, traces).
        max_depth: nesting of maps and arrays; a message's own map is depth 1.
    """

    max_body_bytes: int = 64 * MiB
    max_str_len: int = 1 * MiB
    max_bin_len: int = 16 * MiB
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 16
    max_depth: int = 32

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")

    def unpack_options(self) -> dict[str, Any]:
        """Keyword arguments for ``msgpack.unpackb`` and ``msgpack.Unpacker``.

        ``max_ext_len=0`` refuses every ext type, including msgpack's built-in timestamp
        (which never reaches ``ext_hook``); ``ext_hook`` catches the zero-length ones.
        """
        return {
            "raw": False,
            "use_list": True,
            "strict_map_key": True,
            "max_str_len": self.max_str_len,
            "max_bin_len": self.max_bin_len,
            "max_array_len": self.max_array_len,
            "max_map_len": self.max_map_len,
            "max_ext_len": 0,
            "ext_hook": _refuse_ext,
        }


class _ExtRefused(ValueError):
    pass


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _ExtRefused(f"msgpack ext type {code} is not allowed")


DEFAULT_LIMITS = Limits()


def unpack_error(exc: Exception) -> ProtocolError:
    """Translate an exception raised by msgpack while unpacking into a :class:`ProtocolError`."""
    import msgpack

    text = str(exc)
    if isinstance(exc, _ExtRefused) or "exceeds max_ext_len" in text:
        return ProtocolError(ErrorCode.EXT_NOT_ALLOWED, "msgpack ext types are not allowed")
    if "exceeds max_" in text:  # msgpack: "5 exceeds max_str_len(3)"
        return ProtocolError(ErrorCode.TOO_LARGE, f"value too large: {text}")
    if isinstance(exc, msgpack.exceptions.StackError):
        return ProtocolError(ErrorCode.TOO_LARGE, "nesting too deep")
    if isinstance(exc, msgpack.exceptions.BufferFull):
        return ProtocolError(ErrorCode.TOO_LARGE, "message larger than the buffer limit")
    if isinstance(exc, msgpack.exceptions.ExtraData):
        return ProtocolError(ErrorCode.MALFORMED, "trailing bytes after the message")
    if isinstance(exc, UnicodeDecodeError):
        return ProtocolError(ErrorCode.MALFORMED, f"string is not valid UTF-8: {exc.reason}")
    if "incomplete input" in text:
        return ProtocolError(ErrorCode.MALFORMED, "body ends inside a msgpack object")
    if isinstance(exc, msgpack.exceptions.FormatError):
        return ProtocolError(ErrorCode.MALFORMED, "not valid msgpack (reserved byte)")
    return ProtocolError(ErrorCode.MALFORMED, f"not valid msgpack: {text}")
