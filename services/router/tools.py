"""Tool calling: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as OpenAI defines them.

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}]``; names are ``[a-zA-Z0-9_-]{1,64}`` and unique; ``parameters`` is a JSON
  schema of an object (default: any object), compiled like any constraint so a malformed
  one is a 400 naming ``tools[i].function.parameters``. The legacy ``functions`` /
  ``function_call`` fields are read as ``tools`` / ``tool_choice``.
- ``tool_choice``: ``none`` (tools are not shown to the model and nothing is parsed),
  ``auto`` (the default with tools: the model answers in text or calls tools; a call that
  does not parse or names no tool stays text), ``required`` (one or more calls, or exactly
  one with ``parallel_tool_calls: false``), or ``{"type": "function", "function":
  {"name"}}`` (exactly that function, once).
- ``required`` and a named function are enforced by structured output: the model can
  only produce Hermes ``<tool_call>`` blocks whose JSON is ``{"name": <a tool>,
  "arguments": <its parameters>}``, so the call always parses and validates.

The calls are written in the Hermes format (``<tool_call>\\n{json}\\n</tool_call>``), which
the chat template teaches the model (libs/model/chat_templates.py) and tool_parser.py reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from libs.structured import GrammarSpec
from libs.structured.compiler import JSON_OPTIONS
from services.router.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128

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


def _type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _tool(i: int, entry: Any, *, legacy: bool) -> Tool:
    where = f"functions[{i}]" if legacy else f"tools[{i}]"
    if type(entry) is not dict:
        raise bad_request(f"'{where}' must be an object, got {_type(entry)}", where, "invalid_type")
    if legacy:
        fn, fwhere = entry, where
    else:
        if entry.get("type") != "function":
            raise bad_request(f"'{where}.type' must be 'function', got {entry.get('type')!r}", f"{where}.type")
        unknown = set(entry) - {"type", "function"}
        if unknown:
            key = sorted(unknown)[0]
            raise bad_request(f"Unrecognized request argument supplied: {where}.{key}", f"{where}.{key}", "unknown_parameter")
        fn, fwhere = entry.get("function"), f"{where}.function"
        if type(fn) is not dict:
            raise bad_request(f"'{fwhere}' must be an object, got {_type(fn)}", fwhere, "invalid_type")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        key = sorted(unknown)[0]
        raise bad_request(f"Unrecognized request argument supplied: {fwhere}.{key}", f"{fwhere}.{key}", "unknown_parameter")
    name = fn.get("name")
    if type(name) is not str or not _NAME.match(name):
        raise bad_request(f"'{fwhere}.name' must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", f"{fwhere}.name")
    description = fn.get("description")
    if description is not None and type(description) is not str:
        raise bad_request(f"'{fwhere}.description' must be a string", f"{fwhere}.description", "invalid_type")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if type(parameters) is not dict:
        raise bad_request(f"'{fwhere}.parameters' must be a JSON schema object, got {_type(parameters)}", f"{fwhere}.parameters", "invalid_type")
    if parameters.get("type", "object") != "object":
        raise bad_request(f"'{fwhere}.parameters' must describe an object (type 'object')", f"{fwhere}.parameters")
    strict = fn.get("strict")
    if strict is not None and type(strict) is not bool:
        raise bad_request(f"'{fwhere}.strict' must be a boolean", f"{fwhere}.strict", "invalid_type")
    return Tool(name, description, parameters, bool(strict))


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it has none; a 400 naming what is wrong."""
    legacy = body.get("tools") is None and body.get("functions") is not None
    raw_tools = body.get("functions" if legacy else "tools")
    raw_choice = body.get("function_call" if legacy else "tool_choice")
    if body.get("tools") is not None and body.get("functions") is not None:
        raise bad_request("give 'tools' or the legacy 'functions', not both", "functions")
    param, choice_param = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad_request(f"'parallel_tool_calls' must be a boolean, got {_type(parallel)}", "parallel_tool_calls", "invalid_type")
    if raw_tools is None or raw_tools == []:
        if raw_choice not in (None, "none"):
            raise bad_request(f"'{choice_param}' is only allowed when '{param}' are specified", choice_param)
        return None
    if type(raw_tools) is not list:
        raise bad_request(f"'{param}' must be an array, got {_type(raw_tools)}", param, "invalid_type")
    if len(raw_tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' has {len(raw_tools)} entries, at most {MAX_TOOLS}", param)
    tools = tuple(_tool(i, t, legacy=legacy) for i, t in enumerate(raw_tools))
    names = [t.name for t in tools]
    dupe = next((n for n in names if names.count(n) > 1), None)
    if dupe is not None:
        raise bad_request(f"'{param}' names the function {dupe!r} twice", param)
    choice, named = _choice(raw_choice, choice_param, legacy, set(names))
    return ToolRequest(tools, choice, named, True if parallel is None else parallel)


def _choice(value: Any, param: str, legacy: bool, names: set[str]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return "auto", None
    if type(value) is str:
        if value in ("none", "auto") or (value == "required" and not legacy):
            return value, None  # type: ignore[return-value]
        raise bad_request(f"'{param}' must be 'none', 'auto', 'required' or a function, got {value!r}", param)
    if type(value) is not dict:
        raise bad_request(f"'{param}' must be a string or an object, got {_type(value)}", param, "invalid_type")
    if legacy:
        name = value.get("name")
    else:
        if value.get("type") != "function" or type(value.get("function")) is not dict:
            raise bad_request(f"'{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param)
        name = value["function"].get("name")
    if type(name) is not str or name not in names:
        raise bad_request(f"'{param}' names the function {name!r}, which is not among the tools", param)
    return "named", name


def check_tool_messages(messages: tuple[dict[str, Any], ...]) -> bool:
    """Check the history's tool turns as OpenAI does; True when it has any. Assistant
    ``tool_calls`` need an id, ``type: function`` and a function with a name and JSON
    object ``arguments`` (a string); ``tool`` messages need ``tool_call_id`` and content."""
    any_tools = False
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            any_tools = True
            if type(m.get("tool_call_id")) is not str or not m["tool_call_id"]:
                raise bad_request(f"'messages[{i}].tool_call_id' is required for a tool message", f"messages[{i}].tool_call_id")
            if m.get("content") is None:
                raise bad_request(f"'messages[{i}].content' is required for a tool message", f"messages[{i}].content")
        elif role == "assistant" and m.get("tool_calls") is not None:
            any_tools = True
            calls = m["tool_calls"]
            if type(calls) is not list:
                raise bad_request(f"'messages[{i}].tool_calls' must be an array", f"messages[{i}].tool_calls", "invalid_type")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if type(call) is not dict or type(call.get("id")) is not str or call.get("type") != "function":
                    raise bad_request(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\"}}", where)
                fn = call.get("function")
                if type(fn) is not dict or type(fn.get("name")) is not str or not _NAME.match(fn["name"]):
                    raise bad_request(f"'{where}.function.name' must be a function name", f"{where}.function.name")
                args = fn.get("arguments")
                try:
                    ok = type(args) is str and type(json.loads(args)) is dict
                except json.JSONDecodeError:
                    ok = False
                if not ok:
                    raise bad_request(f"'{where}.function.arguments' must be a JSON object as a string", f"{where}.function.arguments")
        elif role == "function":
            raise bad_request(f"'messages[{i}]': the legacy 'function' role is not supported; use 'tool'", f"messages[{i}].role")
    return any_tools
