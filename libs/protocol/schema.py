"""Field codecs compiled from dataclass annotations: the strict type check of the protocol.

Each annotation (``int``, ``list[int]``, ``SamplingSpec | None``, ``dict[str, float]``,
``Literal["prefill", "decode"]``, ...) compiles once into a codec with two methods:

- ``decode(value, limits, depth)``: check a value unpacked by msgpack against the
  annotation *exactly* (``bool`` is not an ``int``, an ``int`` is not a ``float``) and
  against the size limits, and build nested messages;
- ``encode(value)``: check a value about to be sent and turn it into msgpack-native types,
  so a sender's bug is caught where it is made, not as a 400 from the peer. Encoding is a
  little more forgiving than decoding: numpy-style integers and ints for float fields are
  converted, tuples are sent as arrays.

Errors carry the path below the codec (``[3].top_ids[0]``); each container prefixes its
own segment as the error travels up, so a successful decode builds no path strings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numbers
import types
import typing
from typing import TYPE_CHECKING, Any, Literal

from libs.protocol.errors import ErrorCode, ProtocolError
from libs.protocol.limits import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:
    from libs.protocol.message import Message


def wire_name(value: Any) -> str:
    """The msgpack name of a decoded value's type, for error messages."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bin"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def wrong_type(expected: str, value: Any) -> ProtocolError:
    return ProtocolError(ErrorCode.WRONG_TYPE, f"expected {expected}, got {wire_name(value)}")


def prefix(exc: ProtocolError, segment: str) -> ProtocolError:
    """``exc`` with ``segment`` (``name`` or ``[i]``) prepended to its field path."""
    field = exc.field or ""
    if field and not field.startswith("["):
        field = "." + field
    return ProtocolError(exc.code, exc.message, segment + field)


def _check_depth(depth: int, limits: Limits) -> None:
    if depth > limits.max_depth:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"nested deeper than {limits.max_depth} levels")


def _enter_container(value: Any, codec: Codec, py_type: type, max_len: int, limits: Limits, depth: int) -> int:
    """Check a decoded array or map's type, size and nesting; return the depth inside it."""
    if type(value) is not py_type:
        raise wrong_type(codec.name, value)
    if len(value) > max_len:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{wire_name(value)} larger than {max_len}")
    depth += 1
    _check_depth(depth, limits)
    return depth


class Codec(ABC):
    """Checks and converts one annotated type; see the module docstring."""

    name: str
    #: True when ``decode`` returns its input unchanged and needs no depth (scalars).
    scalar: bool = False

    @abstractmethod
    def decode(self, value: Any, limits: Limits, depth: int) -> Any: ...

    @abstractmethod
    def encode(self, value: Any) -> Any: ...

    def all_valid(self, values: list[Any] | tuple[Any, ...], limits: Limits) -> bool:
        """Whether every item decodes unchanged, if a fast check can tell; False means "look
        item by item" (to find and name the bad one, or because there is no fast check)."""
        return False


class ScalarCodec(Codec):
    """A msgpack scalar of exactly one Python type.

    ``coerce`` lists the other types ``encode`` converts (never ``bool``: it is an ``int``
    subclass in Python but not a number on this wire); ``max_len`` names the
    :class:`Limits` field bounding the value's length, for ``str`` and ``bin``.
    """

    scalar = True

    def __init__(self, py_type: type, name: str, *, coerce: tuple[type, ...] = (), max_len: str | None = None) -> None:
        self.py_type = py_type
        self.name = name
        self.coerce = coerce
        self.max_len = max_len
        self._only_type = frozenset({py_type})

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        if type(value) is not self.py_type:
            raise wrong_type(self.name, value)
        if self.max_len is not None and len(value) > getattr(limits, self.max_len):
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{self.name} longer than {getattr(limits, self.max_len)}")
        return value

    def all_valid(self, values: list[Any] | tuple[Any, ...], limits: Limits) -> bool:
        return self.max_len is None and self._only_type.issuperset(map(type, values))

    def encode(self, value: Any) -> Any:
        if type(value) is self.py_type:
            return value
        if isinstance(value, self.coerce) and not isinstance(value, bool):
            return self.py_type(value)
        raise wrong_type(self.name, value)


class LiteralCodec(Codec):
    """One of a fixed set of strings (``role``, ``finish_reason``)."""

    scalar = True

    def __init__(self, choices: tuple[str, ...]) -> None:
        if not choices or not all(type(c) is str for c in choices):
            raise TypeError(f"Literal choices must be strings, got {choices!r}")
        self.choices = frozenset(choices)
        self.name = " | ".join(repr(c) for c in choices)

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        if type(value) is not str:
            raise wrong_type("str", value)
        if value not in self.choices:
            shown = value if len(value) <= 64 else value[:64] + "..."
            raise ProtocolError(ErrorCode.INVALID_VALUE, f"must be one of {self.name}, got {shown!r}")
        return value

    def encode(self, value: Any) -> Any:
        return self.decode(value, DEFAULT_LIMITS, 0)


class OptionalCodec(Codec):
    """``X | None``: nil or an ``X``."""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"{inner.name} | nil"
        self.scalar = inner.scalar

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        return None if value is None else self.inner.decode(value, limits, depth)

    def encode(self, value: Any) -> Any:
        return None if value is None else self.inner.encode(value)


class ListCodec(Codec):
    """``list[X]``: an array of ``X``; arrays of scalars are checked in place, not copied."""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"array of {inner.name}"

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        depth = _enter_container(value, self, list, limits.max_array_len, limits, depth)
        inner = self.inner
        if inner.scalar and inner.all_valid(value, limits):
            return value  # the hot path (token ids): one C-speed pass, no copy
        i = 0
        try:
            if inner.scalar:
                for i, item in enumerate(value):
                    inner.decode(item, limits, depth)
                return value
            out = []
            for i, item in enumerate(value):
                out.append(inner.decode(item, limits, depth))
            return out
        except ProtocolError as exc:
            raise prefix(exc, f"[{i}]") from None

    def encode(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise wrong_type(self.name, value)
        inner = self.inner
        if inner.scalar and inner.all_valid(value, DEFAULT_LIMITS):
            return value if type(value) is list else list(value)  # the hot path: token ids
        out = []
        for i, item in enumerate(value):
            try:
                out.append(inner.encode(item))
            except ProtocolError as exc:
                raise prefix(exc, f"[{i}]") from None
        return out


class DictCodec(Codec):
    """``dict[str, X]``: a map with string keys (``timings``)."""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = f"map of str to {inner.name}"

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        depth = _enter_container(value, self, dict, limits.max_map_len, limits, depth)
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise ProtocolError(ErrorCode.WRONG_TYPE, f"map keys must be str, got {wire_name(key)}")
            try:
                out[key] = self.inner.decode(item, limits, depth)
            except ProtocolError as exc:
                raise prefix(exc, key) from None
        return out

    def encode(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise wrong_type(self.name, value)
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(ErrorCode.WRONG_TYPE, f"map keys must be str, got {wire_name(key)}")
            try:
                out[key] = self.inner.encode(item)
            except ProtocolError as exc:
                raise prefix(exc, key) from None
        return out


class AnyCodec(Codec):
    """``Any``: free-form data (traces) made of nil, bool, int, float, str, bin, arrays and
    maps with string keys, within the limits. Nothing else, so no ext type and no object."""

    name = "any"

    def __init__(self) -> None:
        self._list = ListCodec(self)
        self._dict = DictCodec(self)

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        t = type(value)
        if value is None or t in (bool, int, float):
            return value
        if t is str:
            return STR.decode(value, limits, depth)
        if t is bytes:
            return BYTES.decode(value, limits, depth)
        if t is list:
            return self._list.decode(value, limits, depth)
        if t is dict:
            return self._dict.decode(value, limits, depth)
        raise wrong_type("nil, bool, int, float, str, bin, array or map", value)

    def encode(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, (list, tuple)):
            return self._list.encode(value)
        if isinstance(value, dict):
            return self._dict.encode(value)
        raise wrong_type("nil, bool, int, float, str, bin, array or map", value)


class MessageCodec(Codec):
    """A nested message, sent as its own map with ``type`` and ``version``."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls
        self.name = f"{cls.TYPE} message"

    def decode(self, value: Any, limits: Limits, depth: int) -> Any:
        from libs.protocol.message import from_wire

        return from_wire(value, self.cls, limits=limits, _depth=depth + 1)

    def encode(self, value: Any) -> Any:
        if not isinstance(value, self.cls):
            raise wrong_type(self.name, value)
        return value.to_wire()


INT = ScalarCodec(int, "int", coerce=(numbers.Integral,))  # numpy/torch ints from an engine
FLOAT = ScalarCodec(float, "float", coerce=(numbers.Real,))  # ints for float fields
BOOL = ScalarCodec(bool, "bool")
STR = ScalarCodec(str, "str", coerce=(str,), max_len="max_str_len")
BYTES = ScalarCodec(bytes, "bin", coerce=(bytearray, memoryview), max_len="max_bin_len")
ANY = AnyCodec()
_SIMPLE: dict[Any, Codec] = {int: INT, float: FLOAT, bool: BOOL, str: STR, bytes: BYTES, Any: ANY}


def compile_type(tp: Any) -> Codec:
    """The codec for annotation ``tp``; ``TypeError`` for anything the protocol cannot carry."""
    from libs.protocol.message import Message

    if tp in _SIMPLE:
        return _SIMPLE[tp]
    if isinstance(tp, type) and issubclass(tp, Message):
        return MessageCodec(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(inner) != 1:
            raise TypeError(f"only 'X | None' unions are supported, got {tp!r}")
        return OptionalCodec(compile_type(inner[0]))
    if origin is Literal:
        return LiteralCodec(args)
    if origin is list and len(args) == 1:
        return ListCodec(compile_type(args[0]))
    if origin is dict and len(args) == 2 and args[0] is str:
        return DictCodec(compile_type(args[1]))
    raise TypeError(f"unsupported field type {tp!r}")
