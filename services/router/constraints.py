"""Output constraints a request asks for, read from every field that can ask for one.

Structured outputs can be requested four ways, and all land in one
:class:`~libs.structured.GrammarSpec`:

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or JSON text),
  ``regex``, ``choice`` (strings), ``grammar`` (EBNF/GBNF or Lark), ``json_object: true``;
  ``disable_fallback`` is accepted (there is no fallback engine), ``disable_any_whitespace``
  only as ``true`` (JSON output is always compact), and the options this server cannot
  honour (``structural_tag``, ``whitespace_pattern``, ``disable_additional_properties``)
  are refused with a 400 naming them;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
- llama.cpp's ``grammar`` (GBNF) and ``json_schema`` (a schema object).

At most one of them may constrain a request (two are a 400 ``conflicting_parameters``:
which one would win?), and a tool call forced by ``tool_choice`` is a constraint too
(tools.py). Fields are read through :class:`~services.router.fields.Fields`, so the rules
of every other field hold here (``null`` is "not given", unknown keys are a 400 naming
them). The spec is then compiled by the router on its bounded executor (prepare.py;
libs/structured, cached), so a malformed schema, regex or grammar is a 400
``invalid_grammar`` naming the field and the problem before anything goes downstream;
a schema given as JSON text that does not parse is the same 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libs.structured import GrammarError, GrammarSpec
from services.router.errors import ApiError, bad_request
from services.router.fields import Fields, json_type

# Every field that can constrain a request's output: api.py lists them among the fields
# both endpoints read, openapi.py describes them.
CONSTRAINT_FIELDS = frozenset(
    {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
     "grammar", "json_schema"}
)  # fmt: skip
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_FIELDS = frozenset(
    {*STRUCTURED_KINDS, "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
     "whitespace_pattern", "structural_tag"}
)  # fmt: skip
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field it came from (what a 400 names)."""

    spec: GrammarSpec
    param: str


def invalid_grammar(message: str, param: str) -> ApiError:
    return bad_request(message, param, "invalid_grammar")


def conflict(message: str, param: str) -> ApiError:
    """A 400 for fields each valid alone that cannot be given together."""
    return bad_request(message, param, "conflicting_parameters")


def _schema(value: Any, param: str, *, strict: bool = False) -> GrammarSpec:
    """A JSON schema given as an object, a boolean or (vLLM) JSON text."""
    if type(value) is str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid_grammar(f"'{param}' is not valid JSON: {e}", param) from None
        if type(value) not in (dict, bool):
            raise invalid_grammar(f"'{param}' must be a JSON schema (an object), got {json_type(value)}", param)
    if type(value) not in (dict, bool):
        raise bad_request(f"'{param}' must be a JSON schema (an object), got {json_type(value)}", param, "invalid_type")
    return GrammarSpec.json_schema(value, strict=strict)


def _string(value: Any, param: str) -> str:
    if type(value) is not str:
        raise bad_request(f"'{param}' must be a string, got {json_type(value)}", param, "invalid_type")
    if not value:
        raise bad_request(f"'{param}' must not be empty", param)
    return value


def _choice(value: Any, param: str) -> GrammarSpec:
    if type(value) is not list or not value or not all(type(c) is str and c for c in value):
        raise bad_request(f"'{param}' must be a non-empty array of non-empty strings", param, "invalid_type")
    return GrammarSpec.choice(value)


def _response_format(f: Fields) -> Constraint | None:
    fmt = f.obj("response_format")
    kind = fmt.required_string("type")
    if kind not in RESPONSE_FORMATS:
        allowed = ", ".join(f"'{k}'" for k in RESPONSE_FORMATS)
        raise bad_request(f"'{fmt.name('type')}' must be one of {allowed}, got {kind!r}", fmt.name("type"))
    fmt.only({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(GrammarSpec("json_object"), fmt.path)
    js = Fields.of(fmt.raw("json_schema"), fmt.name("json_schema")) if fmt.given("json_schema") else None
    if js is None:
        raise bad_request(f"'{fmt.name('json_schema')}' is required when the type is 'json_schema'", fmt.name("json_schema"), "missing_required_parameter")
    js.only(JSON_SCHEMA_FIELDS)
    name = js.string("name", None)
    if name is not None and not name:
        raise bad_request(f"'{js.name('name')}' must not be empty", js.name("name"))
    js.string("description", None)
    strict = js.boolean("strict", False)
    if not js.given("schema"):
        return Constraint(GrammarSpec("json_object"), fmt.path)
    return Constraint(_schema(js.raw("schema"), js.name("schema"), strict=strict), js.name("schema"))


def _structured_outputs(so: Fields) -> Constraint:
    so.only(STRUCTURED_FIELDS)
    for key in ("structural_tag", "whitespace_pattern"):
        if so.given(key):
            raise bad_request(f"'{so.name(key)}' is not supported", so.name(key), "unsupported_parameter")
    if so.boolean("disable_additional_properties", False):
        raise bad_request(
            f"'{so.name('disable_additional_properties')}': true is not supported",
            so.name("disable_additional_properties"),
            "unsupported_parameter",
        )
    if not so.boolean("disable_any_whitespace", True):
        raise bad_request(
            f"'{so.name('disable_any_whitespace')}': false is not supported (JSON output is always compact)",
            so.name("disable_any_whitespace"),
            "unsupported_parameter",
        )
    so.boolean("disable_fallback", False)  # there is no fallback engine either way
    given = [k for k in STRUCTURED_KINDS[:-1] if so.given(k)]
    if so.boolean("json_object", False):
        given.append("json_object")
    if len(given) != 1:
        raise bad_request(
            f"'{so.path}' must set exactly one of {', '.join(STRUCTURED_KINDS)} (got {len(given)})", so.path
        )
    return Constraint(_spec(given[0], so.raw(given[0]), so.name(given[0])), so.name(given[0]))


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return _schema(value, param)
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "choice":
        return _choice(value, param)
    return GrammarSpec("regex" if kind == "regex" else "grammar", _string(value, param))


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one output constraint ``body`` asks for, or None; a 400 naming what is wrong."""
    f = Fields(body)
    found: list[Constraint] = []
    if f.given("response_format"):
        c = _response_format(f)
        if c is not None:
            found.append(c)
    if f.given("structured_outputs"):
        found.append(_structured_outputs(f.obj("structured_outputs")))
    for field, kind in _GUIDED.items():
        if f.given(field):
            found.append(Constraint(_spec(kind, f.raw(field), field), field))
    if f.given("grammar"):  # llama.cpp
        found.append(Constraint(GrammarSpec("grammar", _string(f.raw("grammar"), "grammar")), "grammar"))
    if f.given("json_schema"):  # llama.cpp
        found.append(Constraint(_schema(f.raw("json_schema"), "json_schema"), "json_schema"))
    if len(found) > 1:
        names = ", ".join(f"'{c.param}'" for c in found)
        raise conflict(f"only one output constraint may be given, got {names}", found[1].param)
    return found[0] if found else None


def compile_error(e: GrammarError, param: str) -> ApiError:
    """The 400 for a constraint that does not compile, naming the field and the problem."""
    return invalid_grammar(f"'{param}' is invalid: {e}", param)
