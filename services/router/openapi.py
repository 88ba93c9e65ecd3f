"""The router's OpenAPI 3.1 document, served at ``GET /openapi.json``.

It is written to match the real validation (api.py, chat_messages.py, constraints.py,
tools.py, tokenize.py, body.py), field for field, so a client, a code generator or a
fuzzer can trust it:

- every field an endpoint reads is listed with its exact type and bounds, and nothing
  else is allowed (``additionalProperties: false``), because the router refuses unknown
  fields with a 400 naming them;
- fields the router cannot honour are listed with only their no-op value allowed
  (``"store": false``, ``"suffix": ""``, ``"modalities": ["text"]``);
- ``null`` is allowed wherever the router reads it as "not given";
- what a schema cannot express is a documented 400: rules between fields (``best_of``
  at least ``n``, and equal to it when streaming, ``stream_options`` needs ``stream``, one output constraint a request,
  ``tool_choice`` naming one of ``tools``, a ``tool`` message answering a call before it),
  prompt + ``max_tokens`` within the context, and whether a JSON schema, regex or grammar
  compiles (``invalid_grammar``: the grammar engine decides); so are 413 (the body size),
  429 (with ``Retry-After``) and 503.

tests/unit/test_router_openapi.py keeps the document and the parser in step, and the
schemathesis run (tests/integration/test_fuzz_router.py, ``make fuzz``) checks the live
router against it: valid requests never fail the server, invalid ones get a 4xx.
"""

from __future__ import annotations

from typing import Any

from libs.protocol.messages import MAX_LOGIT_BIAS, MAX_LOGPROBS
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
from services.router.chat_messages import ROLES, TOOL_CALL_FIELDS, TOOL_CALL_FUNCTION_FIELDS
from services.router.constraints import (
    CONSTRAINT_FIELDS,
    JSON_SCHEMA_FIELDS,
    RESPONSE_FORMATS,
    STRUCTURED_FIELDS,
    STRUCTURED_KINDS,
)
from services.router.tokenize import DETOKENIZE_FIELDS, TOKENIZE_CHAT_FIELDS, TOKENIZE_PROMPT_FIELDS
from services.router.tools import FUNCTION_FIELDS, MAX_TOOLS, NAME, TOOL_FIELDS, TOOL_REQUEST_FIELDS

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
TEXT: Schema = {"type": "string", "minLength": 1}  # a string that must say something
BOOLEAN: Schema = {"type": "boolean"}
# A JSON schema as a constraint takes: an object, a boolean, or (vLLM) its JSON text.
# Whether it is a valid schema is the grammar engine's to say (400 invalid_grammar).
SCHEMA_VALUE: Schema = {"anyOf": [{"type": "object"}, BOOLEAN, STRING]}
CHOICE_LIST: Schema = {"type": "array", "items": TEXT, "minItems": 1}


def below(limit: int) -> str:
    """A regex of the decimal integers in [0, ``limit``), leading zeros allowed (as
    ``logit_bias`` keys are read: ASCII digits, then their value)."""
    top = str(limit - 1)
    alts = []
    if len(top) > 1:  # every shorter number
        alts.append(f"[0-9]{{1,{len(top) - 1}}}")
    for i, digit in enumerate(top):  # same length: equal up to i, smaller at i, anything after
        d = int(digit)
        low = 1 if i == 0 and len(top) > 1 else 0
        if d > low:
            rest = len(top) - i - 1
            digits = str(low) if d - 1 == low else f"[{low}-{d - 1}]"
            alts.append(top[:i] + digits + ("[0-9]" + (f"{{{rest}}}" if rest > 1 else "") if rest else ""))
    alts.append(top)
    return "^0*(?:" + "|".join(alts) + ")$"


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
        "logit_bias": nullable(
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": below(vocab_size)},
                "additionalProperties": number(-100.0, 100.0),
            }
        ),
        "user": nullable(STRING),
        "top_k": nullable(integer(-1, TOP_K_MAX)),
        "min_p": nullable(number(0.0, 1.0)),
        "repetition_penalty": nullable(number(0.0, 10.0, lo_open=True)),
        "ignore_eos": nullable(BOOLEAN),
        "min_tokens": nullable(integer(0)),
        "stop_token_ids": nullable(_token_ids(vocab_size, min_items=0)),
        "tidepool": nullable(closed({name: nullable(BOOLEAN) for name in sorted(TIDEPOOL_FIELDS)})),
        **_constraints(),
    }


def _response_format() -> Schema:
    json_schema = closed(
        {
            "name": nullable(TEXT),
            "description": nullable(STRING),
            "strict": nullable(BOOLEAN),
            "schema": nullable(SCHEMA_VALUE),
        }
    )
    assert set(json_schema["properties"]) == JSON_SCHEMA_FIELDS
    kinds = [closed({"type": {"const": kind}}, ("type",)) for kind in RESPONSE_FORMATS if kind != "json_schema"]
    kinds.append(closed({"type": {"const": "json_schema"}, "json_schema": json_schema}, ("type", "json_schema")))
    return {"oneOf": kinds}


def _structured_outputs() -> Schema:
    """vLLM's ``structured_outputs``: exactly one of its kinds (constraints.py)."""
    kinds = {"json": SCHEMA_VALUE, "regex": TEXT, "choice": CHOICE_LIST, "grammar": TEXT}
    schema = closed(
        {
            **{kind: nullable(value) for kind, value in kinds.items()},
            "json_object": nullable(BOOLEAN),
            "disable_fallback": nullable(BOOLEAN),
            "disable_any_whitespace": {"enum": [True, None]},  # JSON output is always compact
            "disable_additional_properties": {"enum": [False, None]},
            "whitespace_pattern": NULL,
            "structural_tag": NULL,
        }
    )
    assert set(schema["properties"]) == STRUCTURED_FIELDS

    def only(kind: str) -> Schema:
        others: dict[str, Schema] = {k: NULL for k in kinds if k != kind}
        if kind == "json_object":
            return {"required": [kind], "properties": {kind: {"const": True}, **others}}
        return {"required": [kind], "properties": {kind: {"not": NULL}, "json_object": {"enum": [False, None]}, **others}}

    schema["anyOf"] = [only(kind) for kind in STRUCTURED_KINDS]
    return schema


def _constraints() -> dict[str, Schema]:
    """The fields that constrain the output (constraints.py); at most one a request."""
    fields = {
        "response_format": nullable(_response_format()),
        "structured_outputs": nullable(_structured_outputs()),
        "guided_json": nullable(SCHEMA_VALUE),
        "guided_regex": nullable(TEXT),
        "guided_choice": nullable(CHOICE_LIST),
        "guided_grammar": nullable(TEXT),
        "grammar": nullable(TEXT),
        "json_schema": nullable(SCHEMA_VALUE),
    }
    assert set(fields) == CONSTRAINT_FIELDS
    return fields


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


FUNCTION_NAME: Schema = {"type": "string", "pattern": NAME.pattern}


def _tool_call() -> Schema:
    """One call in an assistant message's ``tool_calls``; ``arguments`` is a JSON object
    written as a string (a 400 when it is not: a schema cannot say so)."""
    function = closed({"name": FUNCTION_NAME, "arguments": STRING}, ("name", "arguments"))
    call = closed({"id": TEXT, "type": {"const": "function"}, "function": function}, ("id", "type", "function"))
    assert set(function["properties"]) == TOOL_CALL_FUNCTION_FIELDS and set(call["properties"]) == TOOL_CALL_FIELDS
    return call


def _message(role: str) -> Schema:
    """One role's message (chat_messages.py's table); function messages are 400s."""
    if role == "assistant":
        refusal_part = closed({"type": {"const": "refusal"}, "refusal": STRING}, ("type", "refusal"))
        schema = closed(
            {
                "role": {"const": "assistant"},
                "content": nullable(_content(_text_part(), refusal_part)),
                "refusal": nullable(STRING),
                "name": nullable(STRING),
                "tool_calls": nullable({"type": "array", "items": _tool_call()}),
                "function_call": NULL,
                "audio": NULL,
            },
            ("role",),
        )
        # Content, a refusal or a tool call: one of them must say something.
        schema["anyOf"] = [
            {"required": ["content"], "properties": {"content": {"not": NULL}}},
            {"required": ["refusal"], "properties": {"refusal": STRING}},
            {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
        ]
        return schema
    if role == "tool":
        return closed(
            {"role": {"const": "tool"}, "content": _content(_text_part()), "tool_call_id": TEXT},
            ("role", "content", "tool_call_id"),
        )
    return closed({"role": {"const": role}, "content": _content(_text_part()), "name": nullable(STRING)}, ("role", "content"))


def messages_schema() -> Schema:
    return {"type": "array", "minItems": 1, "items": {"oneOf": [_message(role) for role in ROLES if role != "function"]}}


def _function() -> Schema:
    """A function a request offers (tools.py): its parameters are a JSON schema of an object."""
    parameters = {"type": "object", "properties": {"type": {"const": "object"}}}
    schema = closed(
        {"name": FUNCTION_NAME, "description": nullable(STRING), "parameters": nullable(parameters), "strict": nullable(BOOLEAN)},
        ("name",),
    )
    assert set(schema["properties"]) == FUNCTION_FIELDS
    return schema


def tools_schema() -> Schema:
    tool = closed({"type": {"const": "function"}, "function": _function()}, ("type", "function"))
    assert set(tool["properties"]) == TOOL_FIELDS
    return nullable({"type": "array", "items": tool, "maxItems": MAX_TOOLS})


def _tool_fields() -> dict[str, Schema]:
    """``tools`` with ``tool_choice``, or the legacy ``functions`` with ``function_call``."""
    named = closed({"name": STRING}, ("name",))
    fields = {
        "tools": tools_schema(),
        "tool_choice": nullable(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    closed({"type": {"const": "function"}, "function": named}, ("type", "function")),
                ]
            }
        ),
        "parallel_tool_calls": nullable(BOOLEAN),
        "functions": nullable({"type": "array", "items": _function(), "maxItems": MAX_TOOLS}),
        "function_call": nullable({"anyOf": [{"enum": ["none", "auto"]}, named]}),
    }
    assert set(fields) == TOOL_REQUEST_FIELDS
    return fields


def chat_request(served_model: str, vocab_size: int) -> Schema:
    properties = {
        **_common(served_model, vocab_size),
        **_tool_fields(),
        "messages": messages_schema(),
        "logprobs": nullable(BOOLEAN),
        "top_logprobs": nullable(integer(0, MAX_LOGPROBS)),
        "max_completion_tokens": nullable(integer(1)),
        "store": {"enum": [False, None]},
        "modalities": nullable({"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
    }
    assert set(properties) == CHAT_FIELDS
    return closed(properties, ("messages",))


def tokenize_request(served_model: str) -> Schema:
    """Two forms (tokenize.py): a prompt, or chat messages rendered as a chat completion would."""
    model = nullable({"type": "string", "enum": [served_model]})
    prompt = closed(
        {"model": model, "prompt": STRING, "add_special_tokens": nullable(BOOLEAN), "return_token_strs": nullable(BOOLEAN)},
        ("prompt",),
    )
    chat = closed(
        {
            "model": model,
            "messages": messages_schema(),
            "add_generation_prompt": nullable(BOOLEAN),
            "add_special_tokens": nullable(BOOLEAN),
            "return_token_strs": nullable(BOOLEAN),
            "tools": tools_schema(),
            "continue_final_message": {"enum": [False, None]},
        },
        ("messages",),
    )
    assert set(prompt["properties"]) == TOKENIZE_PROMPT_FIELDS and set(chat["properties"]) == TOKENIZE_CHAT_FIELDS
    return {"oneOf": [prompt, chat]}


def detokenize_request(served_model: str, vocab_size: int) -> Schema:
    schema = closed(
        {"model": nullable({"type": "string", "enum": [served_model]}), "tokens": _token_ids(vocab_size, min_items=0)},
        ("tokens",),
    )
    assert set(schema["properties"]) == DETOKENIZE_FIELDS
    return schema


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


FINISH = {"enum": ["stop", "length", "tool_calls", None]}


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
    call = {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": STRING,
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": STRING, "arguments": STRING}},
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": nullable(STRING),
            "tool_calls": {"type": "array", "items": call},
        },
    }
    return _response("chat.completion", _choice("message", message))


def chat_chunk() -> Schema:
    """A streamed chat chunk: a tool call arrives as OpenAI's two deltas (responses.py):
    index, id, type and name with empty arguments, then index and the arguments."""
    call = closed(
        {
            "index": integer(0),
            "id": STRING,
            "type": {"const": "function"},
            "function": closed({"name": STRING, "arguments": STRING}, ("arguments",)),
        },
        ("index", "function"),
    )
    delta = closed({"role": {"const": "assistant"}, "content": STRING, "tool_calls": {"type": "array", "items": call}})
    return _response("chat.completion.chunk", _choice("delta", delta))


def tokenize_response() -> Schema:
    return {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": integer(0),
            "max_model_len": nullable(integer(1)),
            "tokens": {"type": "array", "items": integer(0)},
            "token_strs": nullable({"type": "array", "items": nullable(STRING)}),
        },
    }


DETOKENIZE_RESPONSE: Schema = {"type": "object", "required": ["prompt"], "properties": {"prompt": STRING}}


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


def _operation(summary: str, request: str, ok: Schema, refusals: dict[str, Schema], api_key: bool) -> Schema:
    """A POST taking a JSON body: the router's limits (body.py, admission.py) apply to each."""
    responses = {
        "200": ok,
        "400": _error("invalid request: the error's `param` names the field"),
        "404": _error("unknown model"),
        "408": _error("the body took longer than the router's `body_timeout_s` to arrive"),
        "413": _error("the body is larger than the router's `max_body_bytes`"),
        **refusals,
    }
    if api_key:
        responses["401"] = _error("missing or wrong API key")
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": responses,
        **({"security": [{"bearer": []}]} if api_key else {}),
    }


def _generate(summary: str, request: str, response: str, chunk: str, api_key: bool) -> Schema:
    ok = {
        "description": "the completion: JSON, or server-sent events ending in `data: [DONE]` when `stream` is true",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
            "text/event-stream": {"schema": stream_event(chunk)},
        },
    }
    refusals = {
        "429": _error("the router or every instance is at its queue limit", RETRY_AFTER),
        "502": _error("an instance refused a request the router had accepted"),
        "503": _error("no decode instance is registered, or decode kept failing"),
    }
    return _operation(summary, request, ok, refusals, api_key)


def _utility(summary: str, request: str, response: str, api_key: bool) -> Schema:
    """/tokenize and /detokenize: the same limits as generation, no instance needed."""
    ok = {"description": "ok", "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}}}}
    return _operation(summary, request, ok, {"429": _error("the router is at its queue limit", RETRY_AFTER)}, api_key)


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
            "/v1/completions": {"post": _generate("Completions", "CompletionRequest", "CompletionResponse", "CompletionChunk", api_key)},
            "/v1/chat/completions": {"post": _generate("Chat completions", "ChatRequest", "ChatResponse", "ChatChunk", api_key)},
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
            "/tokenize": {"post": _utility("Token ids of a prompt or of chat messages (vLLM's)", "TokenizeRequest", "TokenizeResponse", api_key)},
            "/detokenize": {"post": _utility("The text of token ids (vLLM's)", "DetokenizeRequest", "DetokenizeResponse", api_key)},
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
                "TokenizeRequest": tokenize_request(served_model),
                "TokenizeResponse": tokenize_response(),
                "DetokenizeRequest": detokenize_request(served_model, vocab_size),
                "DetokenizeResponse": DETOKENIZE_RESPONSE,
                "Error": ERROR,
            }
        },
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document

