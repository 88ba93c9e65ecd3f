"""Chat messages, validated as OpenAI's API validates them, before the template sees them.

Each message is an object whose ``role`` decides which keys it may have:

=============  ==========================================  ===============================
role           keys (required in bold)                     content parts
=============  ==========================================  ===============================
system         **content**, name                           text
developer      **content**, name                           text
user           **content**, name                           text (image, audio, file: 400)
assistant      content, refusal, name (tool_calls: 400)    text, refusal
tool           **content**, **tool_call_id**               text
function       **content**, **name**                       (string only)
=============  ==========================================  ===============================

``content`` is a string or a non-empty array of parts ``{"type": "text", "text": ...}``
(assistant messages may also hold ``{"type": "refusal", "refusal": ...}``). Any other role
(``"wizard"``), an unknown key, a wrong type or a missing required key is a 400 whose
``param`` is the path (``messages[1].content[0].type``).

Refused with a 400 naming them, because this server cannot honour them: image, audio and
file parts (the model reads text only), and tool calling (``tool_calls`` and
``function_call`` in assistant messages; ``tool`` and ``function`` messages answer a call,
so none can be valid until tools are supported).

What the template gets: ``{"role", "content": str, "name"?}``, with text parts joined,
a refusal as the assistant's text, and ``developer`` rendered as ``system`` (OpenAI's
developer messages are the system messages of newer models).
"""

from __future__ import annotations

from typing import Any

from services.router.errors import bad_request
from services.router.fields import Fields, json_type, missing

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


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """The template's messages from the request's ``messages``; a 400 for anything invalid."""
    if value is None:
        raise missing("messages")
    if type(value) is not list:
        raise bad_request(f"'messages' must be an array, got {json_type(value)}", "messages", "invalid_type")
    if not value:
        raise bad_request("'messages' must not be empty", "messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(value: Any, path: str) -> dict[str, Any]:
    f = Fields.of(value, path)
    role = f.required_string("role")
    if role not in ROLES:
        supported = ", ".join(f"'{r}'" for r in ROLES)
        raise bad_request(f"Invalid value: '{role}'. Supported values are: {supported}.", f.name("role"))
    f.only(_KEYS[role], what="message property")
    name = f.string("name", None)
    if role == "assistant":
        _refuse_tool_calls(f)
        content = _content(f, role, required=False)
        refusal = f.string("refusal", None)
        if content is None:
            if refusal is None:
                raise missing(f.name("content"))
            content = refusal
    elif role in ("tool", "function"):
        raise bad_request(
            f"messages with role '{role}' must answer a preceding assistant message's "
            f"{'tool_calls' if role == 'tool' else 'function_call'}, and tool calling is not supported",
            f.name("role"),
            "unsupported_value",
        )
    else:
        content = _content(f, role, required=True)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if name is not None:
        out["name"] = name
    return out


def _refuse_tool_calls(f: Fields) -> None:
    for key in ("tool_calls", "function_call", "audio"):
        value = f.raw(key)
        if value is not None and not (key == "tool_calls" and value == []):
            what = "audio" if key == "audio" else "tool calling"
            raise bad_request(f"'{f.name(key)}' ({what}) is not supported", f.name(key), "unsupported_parameter")


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
