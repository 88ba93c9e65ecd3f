"""/openapi.json matches the router's real validation: schemathesis' generators, fed the
document, produce requests the router accepts (valid ones) and refuses (invalid ones)."""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from libs.structured import GrammarCompiler
from services.router.api import CHAT_FIELDS, COMPLETION_FIELDS
from services.router.errors import ApiError
from services.router.openapi import openapi_document
from services.router.prepare import prepare
from services.router.tokenize import detokenize_body, tokenize_body
from tests.router_harness import MODEL, start_cluster, tokenizer

CONTEXT = 256
DOC = openapi_document(served_model=MODEL, vocab_size=tokenizer().vocab_size, api_key=False)
SCHEMA = schemathesis.openapi.from_dict(DOC)
OPERATIONS = {
    "completion": SCHEMA["/v1/completions"]["POST"],
    "chat": SCHEMA["/v1/chat/completions"]["POST"],
    "tokenize": SCHEMA["/tokenize"]["POST"],
    "detokenize": SCHEMA["/detokenize"]["POST"],
}

# A schema-valid request may still be a 400 for a rule between fields or messages, or
# against the context, which JSON Schema cannot state; these are the only ones (a pattern
# of the param, the code). Besides them, any field's ``conflicting_parameters`` (fields
# valid alone, not together) and ``invalid_grammar`` (a schema, regex or grammar the
# grammar engine refuses: its validity is not a JSON Schema property).
CROSS_FIELD = {
    ("best_of", "invalid_value"),  # below n, or above n with stream
    ("stream_options", "invalid_value"),
    ("top_logprobs", "invalid_value"),
    ("min_tokens", "invalid_value"),
    ("n", "invalid_value"),
    ("max_tokens", "context_length_exceeded"),
    ("prompt", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),
    ("prompt", "empty_prompt"),  # characters the vocabulary cannot spell ("\x06" in SmolLM2's)
    ("tools", "invalid_value"),  # a function named twice
    ("functions", "invalid_value"),
    ("tool_choice", "invalid_value"),  # names no function among the tools
    ("function_call", "invalid_value"),
    (r"messages\[\d+\]\.tool_call_id", "invalid_value"),  # answers no call before it
    (r"messages\[\d+\]\.tool_calls\[\d+\]\.function\.arguments", "invalid_value"),  # not a JSON object
}
ANY_FIELD = {"conflicting_parameters", "invalid_grammar"}


def _cross_field(exc: ApiError) -> bool:
    return exc.code in ANY_FIELD or any(re.fullmatch(p, exc.param or "") and exc.code == c for p, c in CROSS_FIELD)


@lru_cache(maxsize=1)
def _grammars() -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), cache_size=64)


def _prepare(body: Any, kind: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if kind == "tokenize":
        tokenize_body(raw, tokenizer=tokenizer(), served_model=MODEL, max_model_len=CONTEXT, max_json_depth=64, grammars=_grammars(), chat_template=None)
    elif kind == "detokenize":
        detokenize_body(raw, tokenizer=tokenizer(), served_model=MODEL, max_json_depth=64)
    else:
        prepare(raw, kind, tokenizer=tokenizer(), served_model=MODEL, max_model_len=CONTEXT, max_json_depth=64, grammars=_grammars())  # type: ignore[arg-type]


async def test_the_document_is_served_and_lists_every_field() -> None:
    c = await start_cluster(prefills=0, decodes=0, api_key="k")
    try:
        async with c.http() as http, http.get("/openapi.json") as resp:  # no key needed to read it
            assert resp.status == 200
            served = await resp.json()
    finally:
        await c.close()
    assert served["openapi"] == "3.1.0" and served["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    schemas = served["components"]["schemas"]
    assert set(schemas["CompletionRequest"]["properties"]) == COMPLETION_FIELDS
    assert set(schemas["ChatRequest"]["properties"]) == CHAT_FIELDS
    assert schemas["ChatRequest"]["additionalProperties"] is False
    roles = {m["properties"]["role"]["const"] for m in schemas["ChatRequest"]["properties"]["messages"]["items"]["oneOf"]}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        responses = served["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429"} <= set(responses)
        assert "Retry-After" in responses["429"]["headers"]
    assert "503" in served["paths"]["/v1/completions"]["post"]["responses"]


# Examples per operation and mode: 60 in make test (150 until the suite passed 20 minutes);
# TIDEPOOL_OPENAPI_EXAMPLES raises it.
EXAMPLES = int(os.environ.get("TIDEPOOL_OPENAPI_EXAMPLES", "60"))


@pytest.mark.parametrize("kind", list(OPERATIONS))
def test_valid_requests_by_the_document_are_accepted(kind: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=OPERATIONS[kind].as_strategy(generation_mode=GenerationMode.POSITIVE))
    def check(case: Any) -> None:
        body = case.body
        try:
            _prepare(body, kind)
        except ApiError as exc:
            assert _cross_field(exc), f"{exc.status} {exc.param} {exc.code}: {exc.message}\n{body!r}"
            if (exc.param or "").startswith("messages[") and isinstance(body, dict):
                # A tool turn answering no call hides the rest of the body: check it too.
                try:
                    _prepare({**body, "messages": [{"role": "user", "content": "x"}]}, kind)
                except ApiError as again:
                    assert _cross_field(again), f"{again.status} {again.param} {again.code}: {again.message}\n{body!r}"

    check()


@pytest.mark.parametrize("kind", list(OPERATIONS))
def test_invalid_requests_by_the_document_are_refused(kind: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=OPERATIONS[kind].as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def check(case: Any) -> None:
        with pytest.raises(ApiError) as exc:
            _prepare(case.body, kind)
        assert 400 <= exc.value.status < 500

    check()
