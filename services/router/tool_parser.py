"""Hermes tool calls in model output -> OpenAI ``tool_calls``, incrementally for streaming.

The model writes calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Hermes / Qwen / NousResearch format). :class:`HermesToolParser` takes text deltas as they
come and returns what may be sent: content text (holding back a tail that could be the
start of ``<tool_call>``), calls, and both as OpenAI's streaming deltas in order.

A call's ``arguments`` is the model's own text of the ``arguments`` value (``"{}"`` when
it wrote none), not a re-serialization: what is streamed piece by piece and what the
whole response returns are the same string.

Two ways of committing to a call, chosen by ``stream``:

- whole (``stream=False``, the non-streamed response): a block is a call only once it is
  complete and valid: a JSON object with a string ``name`` naming one of the request's
  tools and an object ``arguments`` (or none). Anything else goes out as content, so an
  ``auto`` answer is always either text or valid calls.
- streamed (``stream=True``), as vLLM's Hermes parser streams: the call is announced as
  soon as its ``name`` is complete and names a tool (the first delta: ``index``, ``id``,
  ``type``, ``function.name`` and ``arguments: ""``), then the ``arguments`` text is
  streamed as it is generated (``{"index", "function": {"arguments": piece}}``), whichever
  order the model wrote the two keys in. A block whose name is not a tool is held and
  sent as content, as above. What cannot be taken back: a call announced whose JSON then
  breaks (possible only with ``tool_choice: auto``, which is not grammar-constrained) or
  that ``max_tokens`` cuts short keeps the arguments text generated so far, as OpenAI's
  own streams do when cut; ``required`` and named calls are constrained by their grammar
  and always complete validly, so both forms agree on them exactly.

:class:`_CallScan` finds the top-level ``name`` and ``arguments`` values in the JSON as it
arrives (strings, escapes and nesting only; ``json.loads`` has the last word).
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


def header_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    """OpenAI's first streaming delta of a call: id, type, name, empty arguments."""
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


@dataclass
class Parsed:
    """What a batch of text produced: content to send, calls completed, and both as
    OpenAI's streaming deltas in the order they happened (``{"content": ...}`` or
    ``{"tool_calls": [...]}``)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        if text:
            self.content += text
            self.deltas.append({"content": text})


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _CallScan:
    """Where the top-level values of a JSON object are, as its text arrives.

    ``spans[key] = [start, end]`` for each top-level key (``end`` None while the value is
    still being written). Tracks strings, escapes and nesting, nothing more: a text it
    cannot follow sets ``broken`` (the caller then stops streaming from it)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.depth = 0  # 0 before the object, 1 at its top level
        self.in_string = False
        self.escape = False
        self.state = "object"  # object | key | colon | value | primitive | comma | done
        self.key_start = 0
        self.key: str | None = None
        self.spans: dict[str, list[int | None]] = {}
        self.broken = False

    def scan(self, upto: int) -> None:
        text = self.text
        for i in range(self.pos, upto):
            if self.broken:
                break
            self._char(i, text[i])
        self.pos = max(self.pos, upto)

    def _end_value(self, end: int) -> None:
        if self.key is not None:
            self.spans[self.key][1] = end
        self.state = "comma"

    def _char(self, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.state == "key":
                    try:
                        self.key = json.loads(self.text[self.key_start : i + 1])
                    except json.JSONDecodeError:
                        self.broken = True
                    self.state = "colon"
                elif self.depth == 1 and self.state == "value":
                    self._end_value(i + 1)
            return
        if self.depth > 1:  # inside a nested value: only strings and brackets matter
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._end_value(i + 1)
            return
        if self.state == "primitive":
            if c in ",}" or c.isspace():
                self._end_value(i)
            else:
                return
        if c.isspace():
            return
        if self.state == "object":
            self.broken = c != "{"
            self.depth, self.state = 1, "key"
        elif self.state == "key":
            if c == '"':
                self.in_string, self.key_start = True, i
            else:
                self.broken = c != "}" or bool(self.spans)
                self.depth, self.state = 0, "done"
        elif self.state == "colon":
            self.broken = c != ":"
            self.state = "value"
        elif self.state == "value":
            assert self.key is not None
            self.spans[self.key] = [i, None]
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.state = "primitive"
        elif self.state == "comma":
            if c == ",":
                self.state, self.key = "key", None
            elif c == "}":
                self.depth, self.state = 0, "done"
            else:
                self.broken = True
        else:  # text after the object
            self.broken = True

    def value(self, key: str) -> str | None:
        """The complete value of ``key`` as written, or None."""
        span = self.spans.get(key)
        if span is None or span[1] is None:
            return None
        return self.text[span[0] : span[1]]


@dataclass
class _Announced:
    """A streamed call whose header went out: how much of its arguments did too."""

    index: int
    id: str
    name: str
    sent: str = ""


class HermesToolParser:
    def __init__(self, tool_names: Iterable[str], *, stream: bool = False) -> None:
        self.names = frozenset(tool_names)
        self.stream = stream
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False
        self._scan: _CallScan | None = None
        self._announced: _Announced | None = None
        self._not_a_call = False  # its name names no tool: held, then sent as content

    @property
    def called(self) -> bool:
        """A call has been sent (or announced, streamed)."""
        return bool(self.calls) or self._announced is not None

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _held_prefix(self._buf, OPEN)
                    out.add_content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.add_content(self._buf[:at])
                self._buf = self._buf[at:]
                self._open()
            end = self._buf.find(CLOSE)
            if end < 0:
                self._advance(len(self._buf) - _held_prefix(self._buf, CLOSE), out)
                return out
            self._advance(end, out)
            block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE) :]
            self._close(block[len(OPEN) : end], block, out)

    def finish(self) -> Parsed:
        """Generation ended: an unclosed call whose JSON is complete still counts."""
        out = Parsed()
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._advance(len(rest), out, buf=rest)
            self._close(rest[len(OPEN) :], rest, out)
        else:
            out.add_content(rest)
        return out

    # -- one block ----------------------------------------------------------------------------

    def _open(self) -> None:
        self._in_call = True
        self._scan = _CallScan()
        self._announced = None
        self._not_a_call = False

    def _advance(self, upto: int, out: Parsed, buf: str | None = None) -> None:
        """Scan the block up to ``upto`` (in the buffer); streamed: announce the call once
        its name is known, then send its arguments as they grow."""
        if not self.stream or self._not_a_call:
            return
        scan = self._scan
        assert scan is not None
        scan.text = (self._buf if buf is None else buf)[len(OPEN) :]
        scan.scan(max(0, upto - len(OPEN)))
        if self._announced is None:
            raw = scan.value("name")
            if raw is None:
                return
            name = _json_string(raw)
            if name not in self.names or scan.broken:
                self._not_a_call = True
                return
            self._announced = _Announced(len(self.calls), _call_id(), name)
            out.deltas.append(header_delta(self._announced.index, self._announced.id, name))
        span = scan.spans.get("arguments")
        if span is None or scan.text[span[0]] != "{":
            return
        end = span[1] if span[1] is not None else (scan.pos if not scan.broken else span[0])
        piece = scan.text[span[0] + len(self._announced.sent) : end]
        if piece:
            self._announced.sent += piece
            out.deltas.append(arguments_delta(self._announced.index, piece))

    def _close(self, inner: str, raw: str, out: Parsed) -> None:
        self._in_call = False
        announced, self._announced = self._announced, None
        if announced is not None:  # streamed and announced: it is a call, whatever follows
            valid = self._valid(inner)
            arguments = announced.sent
            if valid is not None and valid[1] != announced.sent:
                missing = valid[1][len(announced.sent) :] if valid[1].startswith(announced.sent) else ""
                if missing:
                    out.deltas.append(arguments_delta(announced.index, missing))
                arguments = announced.sent + missing
            call = ToolCall(announced.index, announced.id, announced.name, arguments)
        else:
            valid = self._valid(inner)
            if valid is None:
                out.add_content(raw)
                return
            call = ToolCall(len(self.calls), _call_id(), *valid)
            out.deltas.append(header_delta(call.index, call.id, call.name))
            out.deltas.append(arguments_delta(call.index, call.arguments))
        out.calls.append(call)
        self.calls.append(call)

    def _valid(self, inner: str) -> tuple[str, str] | None:
        """``(name, arguments text)`` of a complete, valid call, else None."""
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            return None
        if type(obj) is not dict or type(obj.get("name")) is not str or obj["name"] not in self.names:
            return None
        if "arguments" not in obj:
            return obj["name"], "{}"
        if type(obj["arguments"]) is not dict:
            return None
        scan = _CallScan()
        scan.text = inner
        scan.scan(len(inner))
        return obj["name"], scan.value("arguments") or json.dumps(obj["arguments"], ensure_ascii=False)


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if type(value) is str else None


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
