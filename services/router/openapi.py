"""The router's OpenAPI 3.1 document, served at ``GET /openapi.json``.

It is written to match the real validation (api.py, chat_messages.py, body.py), field
for field, so a client, a code generator or a fuzzer can trust it:

- every field an endpoint reads is listed with its exact type and bounds, and nothing
  else is allowed (``additionalProperties: false``), because the router refuses unknown
  fields with a 400 naming them;
- fields the router cannot honour are listed with only their no-op value allowed
  (``"tools": []``, ``"store": false``, ``"logit_bias": {}``);
- ``null`` is allowed wherever the router reads it as "not given";
- what a schema cannot express (``best_of`` must equal ``n``, ``stream_options`` needs
  ``stream``, prompt + ``max_tokens`` within the context, the body size) is a documented
  400/413, as are 429 (with ``Retry-After``) and 503.

tests/unit/test_router_openapi.py keeps the document and the parser in step, and the
schemathesis run (tests/integration/test_fuzz_router.py, ``make fuzz``) checks the live
router against it: valid requests never fail the server, invalid ones get a 4xx.
"""

from __future__ import annotations

from typing import Any

from libs.protocol.messages import MAX_LOGPROBS
from services.router.api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_CHOICES,
    MAX_N,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    STREAM_OPTIONS_FIELDS,
    TIDEPOOL_FIELDS,
    TOP_K_MAX,
)
from services.router.chat_messages import ROLES

Schema = dict[str, Any]

NULL: Schema = {"type": "null"}


def nullable(schema: Schema) -> Schema:
    """``schema`` or ``null``."""
    return {"anyOf": [schema, NULL]}


def closed(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    """An object with exactly these properties (``required`` ones must be there)."""
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def integer(lo: int | None = None, hi: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return schema


def number(lo: float, hi: float, *, lo_open: bool = False) -> Schema:
    low = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return {"type": "number", **low, "maximum": hi}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
EMPTY_ARRAY: Schema = {"type": "array", "maxItems": 0}


def _token_ids(vocab_size: int, *, min_items: int) -> Schema:
    return {"type": "array", "items": integer(0, vocab_size - 1), "minItems": min_items}


def _common(served_model: str, vocab_size: int) -> dict[str, Schema]:
    """The fields both endpoints read (api.COMMON_FIELDS)."""
    return {
        "model": nullable({"type": "string", "enum": [served_model]}),
        "n": nullable(integer(1, MAX_N)),
        "stream": nullable(BOOLEAN),
        "stream_options": nullable(closed({name: nullable(BOOLEAN) for name in sorted(STREAM_OPTIONS_FIELDS)})),
        "max_tokens": nullable(integer(1)),
        "stop": nullable(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                ]
            }
        ),
        "temperature": nullable(number(0.0, 2.0)),
        "top_p": nullable(number(0.0, 1.0, lo_open=True)),
        "presence_penalty": nullable(number(-2.0, 2.0)),
        "frequency_penalty": nullable(number(-2.0, 2.0)),
        "seed": nullable(integer(SEED_MIN, SEED_MAX)),
        "logit_bias": nullable({"type": "object", "maxProperties": 0}),
        "user": nullable(STRING),
        "top_k": nullable(integer(-1, TOP_K_MAX)),
        "min_p": nullable(number(0.0, 1.0)),
        "repetition_penalty": nullable(number(0.0, 10.0, lo_open=True)),
        "ignore_eos": nullable(BOOLEAN),
        "min_tokens": nullable(integer(0)),
        "stop_token_ids": nullable(_token_ids(vocab_size, min_items=0)),
        "tidepool": nullable(closed({name: nullable(BOOLEAN) for name in sorted(TIDEPOOL_FIELDS)})),
    }


def completion_request(served_model: str, vocab_size: int) -> Schema:
    prompt = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
            _token_ids(vocab_size, min_items=1),
            {
                "type": "array",
                "items": _token_ids(vocab_size, min_items=1),
                "minItems": 1,
                "maxItems": MAX_CHOICES,
            },
        ]
    }
    properties = {
        **_common(served_model, vocab_size),
        "prompt": prompt,
        "logprobs": nullable(integer(0, MAX_LOGPROBS)),
        "echo": nullable(BOOLEAN),
        "suffix": nullable({"type": "string", "maxLength": 0}),
        "best_of": nullable(integer(1, MAX_N)),
    }
    assert set(properties) == COMPLETION_FIELDS
    return closed(properties, ("prompt",))


def _text_part() -> Schema:
    return closed({"type": {"const": "text"}, "text": STRING}, ("type", "text"))


def _content(*parts: Schema) -> Schema:
    return {"anyOf": [STRING, {"type": "array", "items": {"anyOf": list(parts)} if len(parts) > 1 else parts[0], "minItems": 1}]}


def _message(role: str) -> Schema:
    """One role's message (chat_messages.py's table); tool and function messages are 400s."""
    if role == "assistant":
        refusal_part = closed({"type": {"const": "refusal"}, "refusal": STRING}, ("type", "refusal"))
        schema = closed(
            {
                "role": {"const": "assistant"},
                "content": nullable(_content(_text_part(), refusal_part)),
                "refusal": nullable(STRING),
                "name": nullable(STRING),
                "tool_calls": nullable(EMPTY_ARRAY),
                "function_call": NULL,
                "audio": NULL,
            },
            ("role",),
        )
        # Content or a refusal: one of them must say something.
        schema["anyOf"] = [
            {"required": ["content"], "properties": {"content": {"not": NULL}}},
            {"required": ["refusal"], "properties": {"refusal": STRING}},
        ]
        return schema
    return closed({"role": {"const": role}, "content": _content(_text_part()), "name": nullable(STRING)}, ("role", "content"))


def chat_request(served_model: str, vocab_size: int) -> Schema:
    messages = {
        "type": "array",
        "minItems": 1,
        "items": {"oneOf": [_message(role) for role in ROLES if role not in ("tool", "function")]},
    }
    properties = {
        **_common(served_model, vocab_size),
        "messages": messages,
        "logprobs": nullable(BOOLEAN),
        "top_logprobs": nullable(integer(0, MAX_LOGPROBS)),
        "max_completion_tokens": nullable(integer(1)),
        "response_format": nullable(closed({"type": {"const": "text"}}, ("type",))),
        "tools": nullable(EMPTY_ARRAY),
        "functions": nullable(EMPTY_ARRAY),
        "tool_choice": {"enum": ["none", None]},
        "function_call": {"enum": ["none", None]},
        "parallel_tool_calls": nullable(BOOLEAN),
        "store": {"enum": [False, None]},
        "modalities": nullable({"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
    }
    assert set(properties) == CHAT_FIELDS
    return closed(properties, ("messages",))


def _usage() -> Schema:
    count = integer(0)
    return {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": count,
            "completion_tokens": count,
            "total_tokens": count,
            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": count}},
        },
    }


def _response(obj: str, choice: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": STRING,
            "object": {"const": obj},
            "created": integer(0),
            "model": STRING,
            "choices": {"type": "array", "items": choice},
            "usage": nullable(_usage()),
            "tidepool": {"type": "object"},
        },
    }


FINISH = {"enum": ["stop", "length", None]}


def _choice(name: str, schema: Schema) -> Schema:
    """A choice carrying its output as ``name`` (text, message or delta)."""
    return {
        "type": "object",
        "required": ["index", name, "finish_reason"],
        "properties": {"index": integer(0), name: schema, "logprobs": nullable({"type": "object"}), "finish_reason": FINISH},
    }


def completion_response() -> Schema:
    """A whole completion, and equally each streamed chunk (OpenAI uses one shape for both)."""
    return _response("text_completion", _choice("text", STRING))


def chat_response() -> Schema:
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": nullable(STRING)},
    }
    return _response("chat.completion", _choice("message", message))


def chat_chunk() -> Schema:
    delta = closed({"role": {"const": "assistant"}, "content": STRING})
    return _response("chat.completion.chunk", _choice("delta", delta))


def stream_event(chunk: str) -> Schema:
    """One server-sent event: a chunk, an error (the stream failed after it started), or
    the final ``[DONE]``. (Before OpenAPI 3.2, a ``text/event-stream`` schema describes
    each event, with its ``data`` as a string.)"""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/Error"}]}
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": STRING,
                "type": STRING,
                "param": nullable(STRING),
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _error(description: str, headers: dict[str, Any] | None = None) -> Schema:
    response: Schema = {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    if headers:
        response["headers"] = headers
    return response


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": integer(1)}}


def _generate(summary: str, request: str, response: str, chunk: str, api_key: bool) -> Schema:
    responses = {
        "200": {
            "description": "the completion: JSON, or server-sent events ending in `data: [DONE]` when `stream` is true",
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                "text/event-stream": {"schema": stream_event(chunk)},
            },
        },
        "400": _error("invalid request: the error's `param` names the field"),
        "404": _error("unknown model"),
        "408": _error("the body took longer than the router's `body_timeout_s` to arrive"),
        "413": _error("the body is larger than the router's `max_body_bytes`"),
        "429": _error("the router or every instance is at its queue limit", RETRY_AFTER),
        "502": _error("an instance refused a request the router had accepted"),
        "503": _error("no decode instance is registered, or decode kept failing"),
    }
    if api_key:
        responses["401"] = _error("missing or wrong API key")
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": responses,
    }


def openapi_document(*, served_model: str, vocab_size: int, api_key: bool) -> Schema:
    """The document for a router serving ``served_model`` (with a vocabulary of ``vocab_size``)."""
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by"],
                    "properties": {"id": STRING, "object": {"const": "model"}, "created": integer(0), "owned_by": STRING, "max_model_len": nullable(integer(1))},
                },
            },
        },
    }
    authed = {"security": [{"bearer": []}]} if api_key else {}
    unauthorized = {"401": _error("missing or wrong API key")} if api_key else {}
    ops = {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}}
    document: Schema = {
        "openapi": "3.1.0",
        "info": {
            "title": "Tidepool",
            "version": "1",
            "description": "OpenAI-compatible completions and chat completions, served with prefill/decode disaggregation.",
        },
        "paths": {
            "/v1/completions": {"post": {**_generate("Completions", "CompletionRequest", "CompletionResponse", "CompletionChunk", api_key), **authed}},
            "/v1/chat/completions": {"post": {**_generate("Chat completions", "ChatRequest", "ChatResponse", "ChatChunk", api_key), **authed}},
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "responses": {"200": {"description": "the model list", "content": {"application/json": {"schema": models}}}, **unauthorized},
                    **authed,
                }
            },
            "/v1/workers": {
                "get": {
                    "summary": "Registered prefill and decode instances",
                    "responses": {"200": {"description": "the instances", "content": {"application/json": {"schema": {"type": "object", "required": ["data"]}}}}, **unauthorized},
                    **authed,
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness",
                    "responses": {**ops, "503": {"description": "unhealthy", "content": {"application/json": {"schema": {"type": "object"}}}}},
                }
            },
            "/stats": {"get": {"summary": "Router statistics", "responses": ops}},
        },
        "components": {
            "schemas": {
                "CompletionRequest": completion_request(served_model, vocab_size),
                "ChatRequest": chat_request(served_model, vocab_size),
                "CompletionResponse": completion_response(),
                "ChatResponse": chat_response(),
                "CompletionChunk": completion_response(),
                "ChatChunk": chat_chunk(),
                "Error": ERROR,
            }
        },
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document

