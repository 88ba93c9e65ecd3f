"""Chat messages, validated as OpenAI's API validates them, before the template sees them.

Each message is an object whose ``role`` decides which keys it may have:

=============  ==============================================  ===========================
role           keys (required in bold)                         content parts
=============  ==============================================  ===========================
system         **content**, name                               text
developer      **content**, name                               text
user           **content**, name                               text (image, audio, file: 400)
assistant      content, refusal, name, tool_calls              text, refusal
               (function_call, audio: 400)
tool           **content**, **tool_call_id**                   text
function       (400: the legacy form of ``tool``)
=============  ==============================================  ===========================

``content`` is a string or a non-empty array of parts ``{"type": "text", "text": ...}``
(assistant messages may also hold ``{"type": "refusal", "refusal": ...}``). An assistant
message says something: content, a refusal or at least one tool call. Any other role
(``"wizard"``), an unknown key, a wrong type or a missing required key is a 400 whose
``param`` is the path (``messages[1].content[0].type``).

Tool turns are checked as OpenAI checks them: each of an assistant's ``tool_calls`` is
``{"id", "type": "function", "function": {"name", "arguments"}}`` with a function name
(``[a-zA-Z0-9_-]{1,64}``) and ``arguments`` a JSON object written as a string; a ``tool``
message answers one of the calls of the assistant message before it (only other tool
messages in between), by its ``tool_call_id``.

Refused with a 400 naming them, because this server cannot honour them: image, audio and
file parts (the model reads text only), and the legacy function-calling history
(``function_call`` in assistant messages, ``function`` messages; send ``tool_calls`` and
``tool`` messages instead: tools.py reads legacy ``functions`` as tools).

What the template gets: ``{"role", "content": str, "name"?}``, with text parts joined,
a refusal as the assistant's text, and ``developer`` rendered as ``system`` (OpenAI's
developer messages are the system messages of newer models); assistant messages keep
their ``tool_calls`` (``{"id", "type", "function": {"name", "arguments"}}``) and tool
messages their ``tool_call_id``, as tool-aware templates read them.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.errors import bad_request
from services.router.fields import Fields, json_type, missing
from services.router.tools import function_name, function_of

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "tool_calls", "function_call", "audio"},
    "tool": {"role", "content", "tool_call_id"},
    "function": {"role", "content", "name"},
}
_PART_TYPES = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
    "function": (),
}
_PART_KEYS = {"text": {"type", "text"}, "refusal": {"type", "refusal"}}
TOOL_CALL_FIELDS = frozenset({"id", "type", "function"})
TOOL_CALL_FUNCTION_FIELDS = frozenset({"name", "arguments"})


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """The template's messages from the request's ``messages``; a 400 for anything invalid."""
    if value is None:
        raise missing("messages")
    if type(value) is not list:
        raise bad_request(f"'messages' must be an array, got {json_type(value)}", "messages", "invalid_type")
    if not value:
        raise bad_request("'messages' must not be empty", "messages")
    messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))
    _check_tool_answers(messages)
    return messages


def has_tool_turns(messages: tuple[dict[str, Any], ...]) -> bool:
    """Whether the history holds tool calls or their results (the template must render them)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _message(value: Any, path: str) -> dict[str, Any]:
    f = Fields.of(value, path)
    role = f.required_string("role")
    if role not in ROLES:
        supported = ", ".join(f"'{r}'" for r in ROLES)
        raise bad_request(f"Invalid value: '{role}'. Supported values are: {supported}.", f.name("role"))
    f.only(_KEYS[role], what="message property")
    name = f.string("name", None)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if role == "assistant":
        _refuse_legacy(f)
        calls = _tool_calls(f)
        content = _content(f, role, required=False)
        refusal = f.string("refusal", None)
        if content is None:
            content = refusal
        if content is None and not calls:
            raise missing(f.name("content"))
        out["content"] = content or ""
        if calls:
            out["tool_calls"] = calls
    elif role == "tool":
        out["content"] = _content(f, role, required=True)
        out["tool_call_id"] = f.required_string("tool_call_id")
        if not out["tool_call_id"]:
            raise bad_request(f"'{f.name('tool_call_id')}' must not be empty", f.name("tool_call_id"))
    elif role == "function":
        raise bad_request(
            "messages with role 'function' (legacy function calling) are not supported; answer a tool call with "
            "a 'tool' message",
            f.name("role"),
            "unsupported_value",
        )
    else:
        out["content"] = _content(f, role, required=True)
    if name is not None:
        out["name"] = name
    return out


def _refuse_legacy(f: Fields) -> None:
    for key, what in (("function_call", "legacy function calling: send 'tool_calls'"), ("audio", "audio")):
        if f.given(key):
            raise bad_request(f"'{f.name(key)}' ({what}) is not supported", f.name(key), "unsupported_parameter")


def _tool_calls(f: Fields) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, each checked as OpenAI checks it."""
    calls = f.array("tool_calls") or []
    out = []
    for j, call in enumerate(calls):
        c = Fields.of(call, f"{f.name('tool_calls')}[{j}]")
        c.only(TOOL_CALL_FIELDS)
        call_id = c.required_string("id")
        if not call_id:
            raise bad_request(f"'{c.name('id')}' must not be empty", c.name("id"))
        fn = function_of(c, TOOL_CALL_FUNCTION_FIELDS)
        name = function_name(fn)
        arguments = fn.required_string("arguments")
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        if type(parsed) is not dict:
            raise bad_request(f"'{fn.name('arguments')}' must be a JSON object written as a string", fn.name("arguments"))
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _check_tool_answers(messages: tuple[dict[str, Any], ...]) -> None:
    """Each tool message answers a call of the assistant message before its run of tool messages."""
    open_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                raise bad_request(
                    f"'messages[{i}]' with role 'tool' must answer a tool call of the preceding assistant message; "
                    f"no call has the id {m['tool_call_id']!r}",
                    f"messages[{i}].tool_call_id",
                )
        else:
            open_ids = {c["id"] for c in m.get("tool_calls", ())}


def _content(f: Fields, role: str, *, required: bool) -> str | None:
    """The message's text: a string, or its text parts joined."""
    value = f.raw("content")
    path = f.name("content")
    if value is None:
        if required:
            raise missing(path)
        return None
    if type(value) is str:
        return value
    if type(value) is not list:
        raise bad_request(
            f"'{path}' must be a string or an array of content parts, got {json_type(value)}", path, "invalid_type"
        )
    if not value:
        raise bad_request(f"'{path}' must not be an empty array", path)
    return "".join(_part(p, f"{path}[{j}]", role) for j, p in enumerate(value))


def _part(value: Any, path: str, role: str) -> str:
    f = Fields.of(value, path)
    kind = f.required_string("type")
    allowed = _PART_TYPES[role]
    if kind not in allowed:
        if kind in ("image_url", "input_audio", "file", "refusal", "text"):
            raise bad_request(
                f"'{f.name('type')}' = '{kind}' is not supported in {role} messages"
                + (" (this model reads text only)" if kind in ("image_url", "input_audio", "file") else ""),
                f.name("type"),
                "unsupported_value",
            )
        supported = ", ".join(f"'{t}'" for t in allowed)
        raise bad_request(f"Invalid value: '{kind}'. Supported values are: {supported}.", f.name("type"))
    if kind not in _PART_KEYS:  # a type the role allows but this server cannot read
        raise bad_request(
            f"'{f.name('type')}' = '{kind}' is not supported (this model reads text only)",
            f.name("type"),
            "unsupported_value",
        )
    f.only(_PART_KEYS[kind], what="content part property")
    return f.required_string(kind)
