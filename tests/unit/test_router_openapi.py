"""/openapi.json matches the router's real validation: schemathesis' generators, fed the
document, produce requests the router accepts (valid ones) and refuses (invalid ones)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from services.router.api import CHAT_FIELDS, COMPLETION_FIELDS
from services.router.errors import ApiError
from services.router.openapi import openapi_document
from services.router.prepare import prepare
from tests.router_harness import MODEL, start_cluster, tokenizer

CONTEXT = 256
DOC = openapi_document(served_model=MODEL, vocab_size=tokenizer().vocab_size, api_key=False)
SCHEMA = schemathesis.openapi.from_dict(DOC)
OPERATIONS = {"completion": SCHEMA["/v1/completions"]["POST"], "chat": SCHEMA["/v1/chat/completions"]["POST"]}

# A schema-valid request may still be a 400 for a rule between fields or against the
# context, which JSON Schema cannot state; these are the only ones (param, code).
CROSS_FIELD = {
    ("best_of", "unsupported_parameter"),
    ("stream_options", "invalid_value"),
    ("top_logprobs", "invalid_value"),
    ("echo", "unsupported_parameter"),
    ("min_tokens", "invalid_value"),
    ("n", "invalid_value"),
    ("max_tokens", "context_length_exceeded"),
    ("prompt", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),
}


def _prepare(body: Any, kind: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    prepare(raw, kind, tokenizer=tokenizer(), served_model=MODEL, max_model_len=CONTEXT, max_json_depth=64)  # type: ignore[arg-type]


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
    assert roles == {"system", "developer", "user", "assistant"}
    responses = served["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(responses)
    assert "Retry-After" in responses["429"]["headers"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_valid_requests_by_the_document_are_accepted(kind: str) -> None:
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=OPERATIONS[kind].as_strategy(generation_mode=GenerationMode.POSITIVE))
    def check(case: Any) -> None:
        try:
            _prepare(case.body, kind)
        except ApiError as exc:
            assert (exc.param, exc.code) in CROSS_FIELD, f"{exc.status} {exc.param} {exc.code}: {exc.message}\n{case.body!r}"

    check()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_invalid_requests_by_the_document_are_refused(kind: str) -> None:
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=OPERATIONS[kind].as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def check(case: Any) -> None:
        with pytest.raises(ApiError) as exc:
            _prepare(case.body, kind)
        assert 400 <= exc.value.status < 500

    check()
