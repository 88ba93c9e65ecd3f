"""Typed access to the fields of a JSON object; every failure is a 400 naming the field.

The API's validation (api.py, chat_messages.py) reads bodies only through :class:`Fields`,
so the rules are the same everywhere:

- ``null`` means "not given";
- types are JSON's: ``true`` is not a number, ``"0.5"`` is not a number, ``2.5`` is not an
  integer; ``2.0`` is the integer 2, as JSON (and JSON Schema, so the OpenAPI document)
  defines numbers by value, whatever their spelling;
- the error's ``param`` is the field's path (``stream_options.include_usage``,
  ``messages[2].content[0].text``), as far as the client needs to find it;
- an object's keys must all be known (:meth:`Fields.only`): an unknown one is a 400 naming
  it, never silently ignored, because a field the server does not read is a field whose
  meaning the client cannot rely on.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, TypeVar

from services.router.errors import ApiError, bad_request


D = TypeVar("D", bool, None)


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _bound(value: int | None) -> str:
    return "-inf" if value is None else str(value)


def missing(name: str) -> ApiError:
    """The 400 for a required field that is absent or null, worded as OpenAI words it."""
    return bad_request(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")


def as_int(value: Any) -> int | None:
    """``value`` as an integer if it is one by JSON's rules (``2`` or ``2.0``), else None."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


class Fields:
    """The fields of one JSON object at ``path`` (empty for the request body itself)."""

    def __init__(self, body: dict[str, Any], path: str = "") -> None:
        self.body = body
        self.path = path

    @classmethod
    def of(cls, value: Any, path: str) -> "Fields":
        """The fields of ``value``, which must be an object (a 400 naming ``path`` if not)."""
        if type(value) is not dict:
            raise bad_request(f"'{path}' must be an object, got {json_type(value)}", path, "invalid_type")
        return cls(value, path)

    def name(self, field: str) -> str:
        """The path of ``field`` in the request, as errors name it."""
        return f"{self.path}.{field}" if self.path else field

    def raw(self, field: str) -> Any:
        return self.body.get(field)

    def given(self, field: str) -> bool:
        return self.body.get(field) is not None

    def only(self, known: Iterable[str], *, what: str = "request argument") -> None:
        """Refuse any key not in ``known`` (400 ``unknown_parameter`` naming the first one)."""
        known = known if isinstance(known, (set, frozenset, dict)) else set(known)
        for key in self.body:
            if key not in known:
                raise bad_request(f"Unrecognized {what} supplied: {self.name(key)}", self.name(key), "unknown_parameter")

    def _typed(self, field: str, py_type: type, label: str) -> Any:
        """The field's value (None when absent or null), which must be exactly ``py_type``."""
        value = self.body.get(field)
        if value is not None and type(value) is not py_type:
            name = self.name(field)
            raise bad_request(f"'{name}' must be {label}, got {json_type(value)}", name, "invalid_type")
        return value

    def integer(self, field: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        raw = self.body.get(field)
        if raw is None:
            return default
        value = as_int(raw)
        if value is None:
            name = self.name(field)
            raise bad_request(f"'{name}' must be an integer, got {json_type(raw)} {raw!r}", name, "invalid_type")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            name = self.name(field)
            raise bad_request(f"'{name}' must be in [{_bound(lo)}, {_bound(hi)}], got {value}", name)
        return value

    def number(self, field: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        value = self.body.get(field)
        if value is None:
            return default
        name = self.name(field)
        if type(value) not in (int, float):
            raise bad_request(f"'{name}' must be a number, got {json_type(value)}", name, "invalid_type")
        value = float(value)
        below = value <= lo if lo_open else value < lo
        if not math.isfinite(value) or below or value > hi:
            interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise bad_request(f"'{name}' must be in {interval}, got {value}", name)
        return value

    def boolean(self, field: str, default: D) -> bool | D:
        value = self._typed(field, bool, "a boolean")
        return default if value is None else value

    def string(self, field: str, default: str | None) -> str | None:
        value = self._typed(field, str, "a string")
        return default if value is None else value

    def required_string(self, field: str) -> str:
        value = self._typed(field, str, "a string")
        if value is None:
            raise missing(self.name(field))
        return value

    def array(self, field: str) -> list[Any] | None:
        return self._typed(field, list, "an array")

    def obj(self, field: str) -> "Fields":
        return Fields(self._typed(field, dict, "an object") or {}, self.name(field))
