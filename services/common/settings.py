"""Typed service settings read from CLI flags and ``TIDEPOOL_*`` environment variables.

Each service declares one frozen dataclass derived from :class:`BaseSettings`; every field
is declared with :func:`setting`, whose ``help`` text becomes the ``--help`` line, so a knob
cannot exist without documentation. A field ``redis_url`` is set by ``--redis-url`` or
``TIDEPOOL_REDIS_URL``; the command line beats the environment, which beats the default.

Supported field types, chosen to cover service configuration without a parsing DSL:

- ``str``, ``int``, ``float``;
- ``bool``: ``--flag`` / ``--no-flag`` on the command line; ``1/true/yes/on`` and
  ``0/false/no/off`` in the environment;
- ``Literal["a", "b"]``: one of the listed strings;
- ``X | None``: an empty string or ``none`` means ``None`` (so an operator can clear a
  default from either source);
- ``tuple[X, ...]``: comma-separated values, e.g. ``--peers a,b``.

A value that does not parse, a missing required field, or a ``ValueError`` from the
dataclass' ``__post_init__`` ends the process with exit status 2 and the usage line, as
argparse does for its own errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar

ENV_PREFIX = "TIDEPOOL_"

S = TypeVar("S", bound="BaseSettings")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def setting(default: Any = dataclasses.MISSING, *, help: str, metavar: str | None = None, secret: bool = False) -> Any:
    """A settings field: ``default`` (omit it for a required knob) and its ``--help`` text.

    A ``secret`` (a token, a password) is left out of the settings' ``repr``, so it never
    reaches a log line; pass it by environment variable rather than on the command line,
    where every user of the machine can read it.
    """
    if not help:
        raise ValueError("every setting needs help text")
    metadata = {"help": help, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed; use a tuple")
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


@dataclass(frozen=True, kw_only=True)
class BaseSettings:
    """Knobs every service has. Subclasses add theirs with ``@dataclass(frozen=True, kw_only=True)``."""

    host: str = setting("127.0.0.1", help="address to bind; localhost unless told otherwise")
    port: int = setting(8000, help="TCP port to bind; 0 picks a free one")
    log_level: LogLevel = setting("info", help="logging level")
    shutdown_timeout_s: float = setting(
        10.0, help="seconds in-flight requests get to finish after SIGINT/SIGTERM"
    )
    internal_token: str | None = setting(
        None,
        help="shared secret of the services: when set, this service's internal endpoints (register, "
        "heartbeat, prefill, decode, abort, the pool's REST API) answer 401 without it, and its calls to "
        "other services carry it. Set the same value on every service, by the environment variable",
        secret=True,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.internal_token is not None and len(self.internal_token) < 16:
            raise ValueError("internal_token must be at least 16 characters (or unset)")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def flag_name(field_name: str) -> str:
    """``redis_url`` -> ``--redis-url``."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """``redis_url`` -> ``TIDEPOOL_REDIS_URL``."""
    return ENV_PREFIX + field_name.upper()


def _converter(tp: Any, name: str) -> Callable[[str], Any]:
    """A function turning one textual value into ``tp``, raising ``ValueError`` with a reason."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"setting {name!r}: only 'X | None' unions are supported, got {tp}")
        convert_inner = _converter(inner[0], name)

        def convert_optional(text: str) -> Any:
            return None if text.strip().lower() in ("", "none") else convert_inner(text)

        return convert_optional
    if origin is Literal:
        choices = tuple(args)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"setting {name!r}: Literal choices must be strings")

        def convert_choice(text: str) -> str:
            if text not in choices:
                raise ValueError(f"must be one of {', '.join(choices)}; got {text!r}")
            return text

        return convert_choice
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"setting {name!r}: only tuple[X, ...] is supported, got {tp}")
        convert_item = _converter(args[0], name)

        def convert_tuple(text: str) -> tuple[Any, ...]:
            return tuple(convert_item(part.strip()) for part in text.split(",") if part.strip())

        return convert_tuple
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):

        def convert_scalar(text: str) -> Any:
            try:
                return tp(text)
            except ValueError:
                raise ValueError(f"not a valid {tp.__name__}: {text!r}") from None

        return convert_scalar
    raise TypeError(f"setting {name!r}: unsupported type {tp!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean (use one of {', '.join(sorted(_TRUE | _FALSE))}): {text!r}")


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a converter so argparse reports its reason instead of a generic 'invalid value'."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _describe_default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "required"
    if isinstance(f.default, tuple):
        return "default: " + (",".join(str(v) for v in f.default) or "(empty)")
    if isinstance(f.default, bool):
        return "default: " + ("on" if f.default else "off")
    return f"default: {f.default}"


def _summary(cls: type) -> str | None:
    """The first line of the class docstring; ``None`` for dataclass' generated signature."""
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(cls.__name__ + "("):
        return None
    return doc.splitlines()[0]


def build_parser(cls: type[BaseSettings], prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser for ``cls``: one option per field, each with its env var and default.

    Options default to ``SUPPRESS`` so that :func:`parse_settings` can tell a flag given on
    the command line from one left out, which is what lets the environment fill the gap.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=_summary(cls),
        epilog=f"Every option can also be set by its {ENV_PREFIX}* environment variable; "
        "a command-line flag wins over the environment, which wins over the default.",
        argument_default=argparse.SUPPRESS,
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help")
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help text; declare it with setting()")
        tp = hints[f.name]
        listed = "comma-separated; " if typing.get_origin(tp) is tuple else ""
        extra = f"({listed}env {env_name(f.name)}; {_describe_default(f)})"
        full_help = f"{help_text} {extra}".replace("%", "%%")  # argparse %-formats help
        if tp is bool:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                help=full_help,
            )
            continue
        convert = _converter(tp, f.name)
        choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
        metavar = f.metadata.get("metavar") or (
            "{" + ",".join(choices) + "}" if choices else f.name.upper()
        )
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=_argparse_type(convert),
            metavar=metavar,
            help=full_help,
        )
    return parser


def parse_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
) -> S:
    """Build ``cls`` from ``argv`` (default ``sys.argv[1:]``) and ``env`` (default ``os.environ``).

    Precedence is CLI > environment > field default. Errors exit with status 2 and usage.
    """
    if env is None:
        env = os.environ
    parser = build_parser(cls, prog)
    given = vars(parser.parse_args(argv))
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        raw = env.get(env_name(f.name))
        if raw is not None:
            try:
                values[f.name] = _converter(hints[f.name], f.name)(raw)
            except ValueError as exc:
                parser.error(f"{env_name(f.name)}: {exc}")
        elif f.default is dataclasses.MISSING:
            parser.error(f"{flag_name(f.name)} (or {env_name(f.name)}) is required")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable: parser.error exits")  # pragma: no cover
