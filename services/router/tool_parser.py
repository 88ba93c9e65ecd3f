"""Hermes tool calls in model output -> OpenAI ``tool_calls``, incrementally for streaming.

The model writes calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Hermes / Qwen / NousResearch format). :class:`HermesToolParser` takes text deltas as they
come and returns what may be sent: content text (holding back a tail that could be the
start of ``<tool_call>``) and complete calls. A block that is not a JSON object with a
string ``name`` naming one of the request's tools and an object ``arguments`` is not a
call: its text goes out as content, so ``auto`` answers are always either text or valid
calls. A call is reported whole, once its closing tag arrived (or generation ended right
after its JSON), as OpenAI's two streaming deltas: id, type and name with empty
arguments, then the arguments.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self) -> list[dict[str, Any]]:
        """OpenAI's streaming form: the header, then the arguments."""
        return [
            {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}},
            {"index": self.index, "function": {"arguments": self.arguments}},
        ]


@dataclass
class Parsed:
    """What a batch of text produced: content to send, and calls completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    def __init__(self, tool_names: Iterable[str]) -> None:
        self.names = frozenset(tool_names)
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _held_prefix(self._buf, OPEN)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:at]
                self._buf = self._buf[at:]
                self._in_call = True
            end = self._buf.find(CLOSE)
            if end < 0:
                return out
            block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE) :]
            self._in_call = False
            self._take(block[len(OPEN) : end], block, out)

    def finish(self) -> Parsed:
        """Generation ended: an unclosed call whose JSON is complete still counts."""
        out = Parsed()
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            self._take(rest[len(OPEN) :], rest, out)
        else:
            out.content += rest
        return out

    def _take(self, inner: str, raw: str, out: Parsed) -> None:
        call = self._call(inner)
        if call is None:
            out.content += raw
        else:
            out.calls.append(call)
            self.calls.append(call)

    def _call(self, inner: str) -> ToolCall | None:
        try:
            obj = json.loads(inner.strip())
        except json.JSONDecodeError:
            return None
        if type(obj) is not dict or type(obj.get("name")) is not str or obj["name"] not in self.names:
            return None
        args = obj.get("arguments", {})
        if type(args) is not dict:
            return None
        return ToolCall(len(self.calls), f"call_{secrets.token_hex(12)}", obj["name"], json.dumps(args, ensure_ascii=False))
