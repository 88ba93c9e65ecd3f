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

At most one of them may constrain a request (two are a 400: which one would win?), and a
tool call forced by ``tool_choice`` is a constraint too (tools.py). The spec is then
compiled by the router on a thread (libs/structured, cached), so a malformed schema, regex
or grammar is a 400 naming the problem before anything goes downstream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libs.structured import GrammarError, GrammarSpec
from services.router.errors import ApiError, bad_request

_STRUCTURED_KEYS = frozenset(
    {"json", "regex", "choice", "grammar", "json_object", "disable_fallback", "disable_any_whitespace",
     "disable_additional_properties", "whitespace_pattern", "structural_tag"}
)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field it came from (what a 400 names)."""

    spec: GrammarSpec
    param: str


def _type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _schema(value: Any, param: str, *, strict: bool = False) -> GrammarSpec:
    if type(value) is str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from None
    if type(value) not in (dict, bool):
        raise bad_request(f"'{param}' must be a JSON schema (an object), got {_type(value)}", param, "invalid_type")
    return GrammarSpec.json_schema(value, strict=strict)


def _string(value: Any, param: str) -> str:
    if type(value) is not str:
        raise bad_request(f"'{param}' must be a string, got {_type(value)}", param, "invalid_type")
    if not value:
        raise bad_request(f"'{param}' must not be empty", param)
    return value


def _choice(value: Any, param: str) -> GrammarSpec:
    if type(value) is not list or not value or not all(type(c) is str and c for c in value):
        raise bad_request(f"'{param}' must be a non-empty array of non-empty strings", param, "invalid_type")
    return GrammarSpec.choice(value)


def _response_format(fmt: Any) -> GrammarSpec | None:
    param = "response_format"
    if type(fmt) is not dict:
        raise bad_request(f"'{param}' must be an object, got {_type(fmt)}", param, "invalid_type")
    kind = fmt.get("type")
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        key = sorted(extra)[0]
        raise bad_request(f"Unrecognized request argument supplied: {param}.{key}", f"{param}.{key}", "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type"
        )
    js = fmt.get("json_schema")
    if type(js) is not dict:
        raise bad_request(f"'{param}.json_schema' must be an object", f"{param}.json_schema", "invalid_type")
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        key = sorted(unknown)[0]
        raise bad_request(
            f"Unrecognized request argument supplied: {param}.json_schema.{key}", f"{param}.json_schema.{key}", "unknown_parameter"
        )
    if "name" in js and (type(js["name"]) is not str or not js["name"]):
        raise bad_request(f"'{param}.json_schema.name' must be a non-empty string", f"{param}.json_schema.name")
    strict = js.get("strict")
    if strict is not None and type(strict) is not bool:
        raise bad_request(f"'{param}.json_schema.strict' must be a boolean", f"{param}.json_schema.strict", "invalid_type")
    if js.get("schema") is None:
        return GrammarSpec("json_object")
    return _schema(js["schema"], f"{param}.json_schema.schema", strict=bool(strict))


def _structured_outputs(so: Any) -> tuple[GrammarSpec, str]:
    param = "structured_outputs"
    if type(so) is not dict:
        raise bad_request(f"'{param}' must be an object, got {_type(so)}", param, "invalid_type")
    for key in so:
        if key not in _STRUCTURED_KEYS:
            raise bad_request(f"Unrecognized request argument supplied: {param}.{key}", f"{param}.{key}", "unknown_parameter")
    for key, refused in (("structural_tag", None), ("whitespace_pattern", None), ("disable_additional_properties", False)):
        if so.get(key) not in (None, refused):
            raise bad_request(f"'{param}.{key}' is not supported", f"{param}.{key}", "unsupported_parameter")
    if so.get("disable_any_whitespace") is False:
        raise bad_request(
            f"'{param}.disable_any_whitespace': false is not supported (JSON output is always compact)",
            f"{param}.disable_any_whitespace",
            "unsupported_parameter",
        )
    for key in ("disable_fallback", "disable_any_whitespace", "json_object"):
        if so.get(key) is not None and type(so[key]) is not bool:
            raise bad_request(f"'{param}.{key}' must be a boolean", f"{param}.{key}", "invalid_type")
    given = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise bad_request(
            f"'{param}' must set exactly one of json, regex, choice, grammar, json_object (got {len(given)})", param
        )
    return _spec(given[0], so.get(given[0]), f"{param}.{given[0]}"), f"{param}.{given[0]}"


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
    found: list[Constraint] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(Constraint(spec, "response_format.json_schema.schema" if spec.kind == "json_schema" else "response_format"))
    if body.get("structured_outputs") is not None:
        spec, param = _structured_outputs(body["structured_outputs"])
        found.append(Constraint(spec, param))
    for field, kind in _GUIDED.items():
        if body.get(field) is not None:
            found.append(Constraint(_spec(kind, body[field], field), field))
    if body.get("grammar") is not None:  # llama.cpp
        found.append(Constraint(GrammarSpec("grammar", _string(body["grammar"], "grammar")), "grammar"))
    if body.get("json_schema") is not None:  # llama.cpp
        found.append(Constraint(_schema(body["json_schema"], "json_schema"), "json_schema"))
    if len(found) > 1:
        names = ", ".join(f"'{c.param}'" for c in found)
        raise bad_request(f"only one output constraint may be given, got {names}", found[1].param)
    return found[0] if found else None


def compile_error(e: GrammarError, param: str) -> ApiError:
    """The 400 for a constraint that does not compile, naming the field and the problem."""
    return bad_request(f"'{param}' is invalid: {e}", param, "invalid_grammar")
