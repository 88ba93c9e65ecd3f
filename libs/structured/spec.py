"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of
a list of strings, or a grammar (EBNF/GBNF or Lark).

A :class:`GrammarSpec` is plain data: it travels from the router to prefill and decode
(``libs.protocol.messages.StructuredSpec`` on the wire) and is the key of the compiled
grammar cache, so two requests with the same schema share one compile. It is canonical:
a JSON schema is re-serialised compactly, so whitespace in the client's JSON does not
defeat the cache. Key order is kept: a schema's property order is the output's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")


class GrammarError(ValueError):
    """The constraint cannot be compiled: a malformed schema, regex or grammar. The message
    names the problem as the grammar engine reports it (services answer it with a 400)."""

    def __init__(self, message: str, *, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint.

    Attributes:
        kind: ``json_schema`` (``value`` is the schema as JSON text), ``json_object`` (any
            JSON object; ``value`` empty), ``regex`` (the whole output matches it),
            ``choice`` (``value`` is a JSON array of strings; the output is one of them),
            ``grammar`` (EBNF/GBNF as llama.cpp and vLLM take it, or Lark) or ``lark``
            (Lark as llguidance reads it, with ``%json`` blocks; what tool calling builds).
        value: the constraint's text, canonical for ``json_schema`` and ``choice``.
        strict: for JSON schemas, refuse keywords the engine cannot enforce (OpenAI's
            ``strict: true``) instead of ignoring them.
    """

    kind: GrammarKind
    value: str = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}", kind=str(self.kind))

    @classmethod
    def json_schema(cls, schema: Any, *, strict: bool = False) -> "GrammarSpec":
        """From a schema given as an object (or JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}", kind="json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object", kind="json_schema")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice must be a non-empty list of strings", kind="choice")
        return cls("choice", json.dumps(list(options), separators=(",", ":")))

    def describe(self) -> str:
        """A short label for logs and traces (never the whole schema)."""
        return f"{self.kind}({len(self.value)} chars)"
