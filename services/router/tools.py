"""Tool calling: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as OpenAI defines them.

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}]``; names are ``[a-zA-Z0-9_-]{1,64}`` and unique; ``parameters`` is a JSON
  schema of an object (default: any object), compiled like any constraint so a malformed
  one is a 400 naming ``tools[i].function.parameters``. The legacy ``functions`` /
  ``function_call`` fields are read as ``tools`` / ``tool_choice``; the two forms do not
  mix (``tools`` with ``function_call`` is a 400 ``conflicting_parameters``).
- Fields are read through :class:`~services.router.fields.Fields`: unknown keys in a tool,
  its function or a named choice are a 400 naming them, ``null`` is "not given".
- ``tool_choice``: ``none`` (tools are not shown to the model and nothing is parsed),
  ``auto`` (the default with tools: the model answers in text or calls tools; a call that
  does not parse or names no tool stays text), ``required`` (one or more calls, or exactly
  one with ``parallel_tool_calls: false``), or ``{"type": "function", "function":
  {"name"}}`` (exactly that function, once).
- ``required`` and a named function are enforced by structured output: the model can
  only produce Hermes ``<tool_call>`` blocks whose JSON is ``{"name": <a tool>,
  "arguments": <its parameters>}``, so the call always parses and validates.

The history's tool turns (assistant ``tool_calls``, ``tool`` messages) are checked with the
other messages (chat_messages.py). The calls are written in the Hermes format
(``<tool_call>\\n{json}\\n</tool_call>``), which the chat template teaches the model
(libs/model/chat_templates.py) and tool_parser.py reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from libs.structured import GrammarSpec
from libs.structured.compiler import JSON_OPTIONS
from services.router.constraints import conflict
from services.router.errors import bad_request
from services.router.fields import Fields, json_type, missing

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# The chat fields this module reads, and the keys of a tool and of its function.
TOOL_REQUEST_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"})
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
CHOICES = ("none", "auto", "required")

ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (``{"type": "function", "function": ...}``)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how they may be used."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None  # the function, for choice == "named"
    parallel: bool

    @property
    def active(self) -> bool:
        """Tools are shown to the model and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def constraint(self) -> GrammarSpec | None:
        """The grammar that forces a valid call (``required`` / named), else None."""
        if self.choice not in ("required", "named"):
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"x-guidance": dict(JSON_OPTIONS, lenient=not all(t.strict for t in tools))}
        if len(calls) == 1:
            schema.update(calls[0])
        else:
            schema["anyOf"] = calls
        call = '"<tool_call>\\n" %json ' + json.dumps(schema) + ' "\\n</tool_call>"'
        many = self.choice == "required" and self.parallel
        return GrammarSpec("lark", f'start: call ("\\n" call)*\ncall: {call}' if many else f"start: {call}")

    def schemas(self) -> list[tuple[str, GrammarSpec]]:
        """Each tool's parameter schema with the field it came from, to compile (validate)."""
        return [
            (f"tools[{i}].function.parameters", GrammarSpec.json_schema(t.parameters, strict=t.strict))
            for i, t in enumerate(self.tools)
        ]


def function_of(f: Fields, known: Iterable[str]) -> Fields:
    """The ``function`` of ``{"type": "function", "function": {...}}`` (a tool, a named
    tool choice, an assistant's tool call), whose keys must all be ``known``."""
    if f.required_string("type") != "function":
        raise bad_request(f"'{f.name('type')}' must be 'function', got {f.raw('type')!r}", f.name("type"))
    if not f.given("function"):
        raise missing(f.name("function"))
    fn = Fields.of(f.raw("function"), f.name("function"))
    fn.only(known)
    return fn


def function_name(fn: Fields) -> str:
    name = fn.required_string("name")
    if not NAME.match(name):
        raise bad_request(f"'{fn.name('name')}' must match {NAME.pattern}, got {name!r}", fn.name("name"))
    return name


def _tool(entry: Any, where: str, *, legacy: bool) -> Tool:
    if legacy:
        fn = Fields.of(entry, where)
        fn.only(FUNCTION_FIELDS)
    else:
        outer = Fields.of(entry, where)
        outer.only(TOOL_FIELDS)
        fn = function_of(outer, FUNCTION_FIELDS)
    name = function_name(fn)
    description = fn.string("description", None)
    parameters = fn.raw("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    param = fn.name("parameters")
    if type(parameters) is not dict:
        raise bad_request(f"'{param}' must be a JSON schema object, got {json_type(parameters)}", param, "invalid_type")
    if parameters.get("type", "object") != "object":
        raise bad_request(f"'{param}' must describe an object (type 'object')", param)
    return Tool(name, description, parameters, fn.boolean("strict", False))


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it has none; a 400 naming what is wrong.

    ``tools`` goes with ``tool_choice``, the legacy ``functions`` with ``function_call``;
    mixing the two forms is a 400, as is a choice without anything to choose from."""
    f = Fields(body)
    legacy = f.given("functions")
    if legacy and f.given("tools"):
        raise conflict("give 'tools' or the legacy 'functions', not both", "functions")
    param, choice_param = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    other_choice = "tool_choice" if legacy else "function_call"
    if f.given(other_choice):
        raise conflict(f"'{other_choice}' goes with '{'tools' if legacy else 'functions'}', not '{param}'", other_choice)
    parallel = f.boolean("parallel_tool_calls", True)
    raw_tools = f.array(param)
    raw_choice = f.raw(choice_param)
    if not raw_tools:
        if raw_choice not in (None, "none"):
            if type(raw_choice) not in (str, dict):
                raise bad_request(f"'{choice_param}' must be a string or an object, got {json_type(raw_choice)}", choice_param, "invalid_type")
            raise conflict(f"'{choice_param}' is only allowed when '{param}' are specified", choice_param)
        return None
    if len(raw_tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' has {len(raw_tools)} entries, at most {MAX_TOOLS}", param)
    tools = tuple(_tool(t, f"{param}[{i}]", legacy=legacy) for i, t in enumerate(raw_tools))
    names = [t.name for t in tools]
    dupe = next((n for n in names if names.count(n) > 1), None)
    if dupe is not None:
        raise bad_request(f"'{param}' names the function {dupe!r} twice", param)
    choice, named = _choice(raw_choice, choice_param, legacy, set(names))
    return ToolRequest(tools, choice, named, parallel)


def _choice(value: Any, param: str, legacy: bool, names: set[str]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return "auto", None
    if type(value) is str:
        if value in CHOICES[:2] or (value == "required" and not legacy):
            return value, None  # type: ignore[return-value]
        allowed = "'none', 'auto' or a function" if legacy else "'none', 'auto', 'required' or a function"
        raise bad_request(f"'{param}' must be {allowed}, got {value!r}", param)
    if type(value) is not dict:
        raise bad_request(f"'{param}' must be a string or an object, got {json_type(value)}", param, "invalid_type")
    f = Fields(value, param)
    if legacy:
        f.only({"name"})
        name = f.required_string("name")
    else:
        f.only(TOOL_FIELDS)
        name = function_of(f, {"name"}).required_string("name")
    if name not in names:
        raise bad_request(f"'{param}' names the function {name!r}, which is not among the tools", param)
    return "named", name
