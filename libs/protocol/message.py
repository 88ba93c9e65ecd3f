"""The message base class, the registry of message types, and encode/decode.

A message is a dataclass deriving from :class:`Message` with its wire version as a class
keyword::

    @dataclass(kw_only=True)
    class AbortRequest(Message, version=1):
        request_id: str

On the wire it is a msgpack map of its fields plus ``type`` (the class name unless
``type_name=`` says otherwise) and ``version``. Nested messages are maps of the same kind,
so every map names what it is. Decoding is strict: the type must be known (and be the one
expected), the version must match, every field without a default must be present, no
unknown field is accepted, and every value must have exactly its annotated type (see
``schema.py``). After the type check, :meth:`Message.validate` checks values (ranges, lengths
that must agree). A field with a default may be left out on the wire; that is how a field is
added without a version bump.

The field codecs are compiled from the annotations on first use and cached per class.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, TypeVar, overload

import msgpack

from libs.protocol.errors import ErrorCode, ProtocolError
from libs.protocol.limits import DEFAULT_LIMITS, Limits, unpack_error
from libs.protocol.schema import Codec, compile_type, prefix, wire_name

M = TypeVar("M", bound="Message")

_RESERVED = frozenset({"type", "version"})
_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class _Field:
    name: str
    codec: Codec
    required: bool


@dataclass(frozen=True)
class _Schema:
    fields: tuple[_Field, ...]
    names: frozenset[str]  # field names plus "type" and "version": every allowed key


_SCHEMAS: dict[type, _Schema] = {}


class Message:
    """Base of every wire message; subclasses are dataclasses declared with ``version=``."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]

    def __init_subclass__(cls, *, version: int, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type(version) is not int or version < 1:
            raise TypeError(f"{cls.__name__}: version must be a positive int")
        cls.TYPE = type_name or cls.__name__
        cls.VERSION = version
        existing = _REGISTRY.get(cls.TYPE)
        if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"message type {cls.TYPE!r} is already taken by {existing.__module__}.{existing.__qualname__}"
            )
        _REGISTRY[cls.TYPE] = cls
        _SCHEMAS.pop(cls, None)

    def validate(self) -> None:
        """Check values beyond their types; raise ``ProtocolError(INVALID_VALUE)`` via :func:`check`.

        Called after decoding and before encoding. The default accepts everything.
        """

    def to_wire(self) -> dict[str, Any]:
        """This message as msgpack-native data (a map with ``type`` and ``version``)."""
        out: dict[str, Any] = {"type": self.TYPE, "version": self.VERSION}
        for f in _schema(type(self)).fields:
            try:
                out[f.name] = f.codec.encode(getattr(self, f.name))
            except ProtocolError as exc:
                raise prefix(exc, f.name) from None
        self.validate()  # after the type checks, so value rules compare values of the right type
        return out


def check(condition: bool, field: str, problem: str) -> None:
    """Raise ``invalid_value`` for ``field`` unless ``condition``; for :meth:`Message.validate`."""
    if not condition:
        raise ProtocolError(ErrorCode.INVALID_VALUE, problem, field)


def message_types() -> Mapping[str, type[Message]]:
    """Every registered message class by wire type name (read-only)."""
    return MappingProxyType(_REGISTRY)


def _schema(cls: type[Message]) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is not None:
        return schema
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in _RESERVED:
            raise TypeError(f"{cls.__name__}.{f.name}: 'type' and 'version' are reserved on the wire")
        try:
            codec = compile_type(hints[f.name])
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{f.name}: {exc}") from None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append(_Field(f.name, codec, required))
    schema = _Schema(tuple(fields), frozenset(f.name for f in fields) | _RESERVED)
    _SCHEMAS[cls] = schema
    return schema


def encode(message: Message) -> bytes:
    """The msgpack bytes of ``message`` (validated on the way; ``ProtocolError`` if invalid)."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


@overload
def decode(data: bytes | bytearray | memoryview, expected: type[M], *, limits: Limits = ...) -> M: ...
@overload
def decode(data: bytes | bytearray | memoryview, expected: None = None, *, limits: Limits = ...) -> Message: ...
def decode(
    data: bytes | bytearray | memoryview,
    expected: type[Message] | None = None,
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Decode one message from a whole body; ``expected`` pins its type (else any registered).

    Raises :class:`ProtocolError` on any problem: size, msgpack syntax, trailing bytes, type,
    version, fields, values.
    """
    if len(data) > limits.max_body_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {len(data)} bytes exceeds {limits.max_body_bytes}")
    try:
        obj = msgpack.unpackb(data, **limits.unpack_options())
    except (ValueError, msgpack.exceptions.UnpackException) as exc:
        raise unpack_error(exc) from None
    return from_wire(obj, expected, limits=limits)


@overload
def from_wire(obj: Any, expected: type[M], *, limits: Limits = ..., _depth: int = ...) -> M: ...
@overload
def from_wire(obj: Any, expected: None = None, *, limits: Limits = ..., _depth: int = ...) -> Message: ...
def from_wire(
    obj: Any,
    expected: type[Message] | None = None,
    *,
    limits: Limits = DEFAULT_LIMITS,
    _depth: int = 1,
) -> Message:
    """Build a message from already-unpacked msgpack data, with every check :func:`decode` does."""
    if type(obj) is not dict:
        raise ProtocolError(ErrorCode.WRONG_TYPE, f"expected a message (map), got {wire_name(obj)}")
    if _depth > limits.max_depth:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"nested deeper than {limits.max_depth} levels")
    if len(obj) > limits.max_map_len:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"map larger than {limits.max_map_len}")
    cls = _message_class(obj, expected)
    version = obj.get("version")
    if "version" not in obj:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "required field missing", "version")
    if type(version) is not int:
        raise ProtocolError(ErrorCode.WRONG_TYPE, f"expected int, got {wire_name(version)}", "version")
    if version != cls.VERSION:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION, f"{cls.TYPE} version {version} is not supported (expected {cls.VERSION})", "version"
        )
    schema = _schema(cls)
    unknown = obj.keys() - schema.names
    if unknown:
        key = sorted(unknown, key=repr)[0]
        if type(key) is not str:
            raise ProtocolError(ErrorCode.WRONG_TYPE, f"map keys must be str, got {wire_name(key)}")
        raise ProtocolError(ErrorCode.UNKNOWN_FIELD, f"not a field of {cls.TYPE}", key)
    values: dict[str, Any] = {}
    for f in schema.fields:
        if f.name in obj:
            try:
                values[f.name] = f.codec.decode(obj[f.name], limits, _depth)
            except ProtocolError as exc:
                raise prefix(exc, f.name) from None
        elif f.required:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"required field of {cls.TYPE} missing", f.name)
    message = cls(**values)
    message.validate()
    return message


def _message_class(obj: dict[Any, Any], expected: type[Message] | None) -> type[Message]:
    if "type" not in obj:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "required field missing", "type")
    type_name = obj["type"]
    if type(type_name) is not str:
        raise ProtocolError(ErrorCode.WRONG_TYPE, f"expected str, got {wire_name(type_name)}", "type")
    registered = _REGISTRY.get(type_name)
    shown = type_name if len(type_name) <= 64 else type_name[:64] + "..."
    if expected is not None and type_name != expected.TYPE:
        if registered is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {shown!r}", "type")
        raise ProtocolError(ErrorCode.UNEXPECTED_TYPE, f"expected {expected.TYPE}, got {shown}", "type")
    if registered is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {shown!r}", "type")
    return expected or registered
