"""Request validation as OpenAI does it: chat roles and content parts, and every field
honoured or refused with a 400 naming it (services/router/api.py, chat_messages.py)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import openai
import pytest

from services.router.api import CHAT_FIELDS, COMPLETION_FIELDS, parse_request
from services.router.errors import ApiError
from tests.router_harness import MODEL, Cluster, script_text, start_cluster, tokenizer


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster()
    yield c
    await c.close()


_CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def chat(messages: Any, **extra: Any) -> Any:
    return parse_request({"messages": messages, **extra}, "chat", served_model=MODEL, vocab_size=49152)


def refused(body: dict[str, Any], kind: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as exc:
        parse_request(body, kind, served_model=MODEL, vocab_size=49152)  # type: ignore[arg-type]
    assert exc.value.status == 400
    return exc.value


async def test_role_wizard_is_400_through_the_openai_client(cluster: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])  # type: ignore[misc,list-item]
    assert exc.value.status_code == 400 and exc.value.param == "messages[0].role" and exc.value.code == "invalid_value"
    assert "'wizard'" in exc.value.message and "'developer'" in exc.value.message
    assert cluster.decodes[0].requests == []
    ok = await cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == script_text(0)


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role", "invalid_value"),
        ([{"role": "User", "content": "x"}], "messages[0].role", "invalid_value"),
        ([{"content": "x"}], "messages[0].role", "missing_required_parameter"),
        ([{"role": None, "content": "x"}], "messages[0].role", "missing_required_parameter"),
        ([{"role": ["user"], "content": "x"}], "messages[0].role", "invalid_type"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "system", "content": None}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": []}], "messages[0].content", "invalid_value"),
        ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "invalid_type"),
        ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type", "missing_required_parameter"),
        ([{"role": "user", "content": [{"type": "txt", "text": "hi"}]}], "messages[0].content[0].type", "invalid_value"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "missing_required_parameter"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text", "invalid_type"),
        ([{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}], "messages[0].content[0].x", "unknown_parameter"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "messages[0].content[0].type", "unsupported_value"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0].type", "unsupported_value"),
        ([{"role": "system", "content": [{"type": "refusal", "refusal": "no"}]}], "messages[0].content[0].type", "unsupported_value"),
        ([{"role": "user", "content": "x", "tool_call_id": "a"}], "messages[0].tool_call_id", "unknown_parameter"),
        ([{"role": "user", "content": "x", "foo": 1}], "messages[0].foo", "unknown_parameter"),
        ([{"role": "user", "content": "x", "name": 5}], "messages[0].name", "invalid_type"),
        ([{"role": "assistant"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": []}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "assistant", "content": "x", "tool_calls": {"id": "1"}}], "messages[0].tool_calls", "invalid_type"),
        ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls[0].type", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls[0].id", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "tool", "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls[0].type", "invalid_value"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}], "messages[0].tool_calls[0].function", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "a b", "arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name", "invalid_value"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}], "messages[0].tool_calls[0].function.arguments", "invalid_type"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}], "messages[0].tool_calls[0].function.arguments", "invalid_value"),
        ([{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}}]}], "messages[0].tool_calls[0].function.x", "unknown_parameter"),
        ([{"role": "assistant", "content": "x", "function_call": {"name": "f"}}], "messages[0].function_call", "unsupported_parameter"),
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", "missing_required_parameter"),
        ([{"role": "tool", "tool_call_id": "call_1"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"}], "messages[0].name", "unknown_parameter"),
        ([{"role": "tool", "content": "42", "tool_call_id": "call_1"}], "messages[0].tool_call_id", "invalid_value"),  # answers no call
        ([{"role": "user", "content": "x"}, _CALL, {"role": "user", "content": "y"}, {"role": "tool", "content": "1", "tool_call_id": "call_1"}], "messages[3].tool_call_id", "invalid_value"),
        ([_CALL, {"role": "tool", "content": "1", "tool_call_id": "call_2"}], "messages[1].tool_call_id", "invalid_value"),
        ([{"role": "function", "content": "42", "name": "f"}], "messages[0].role", "unsupported_value"),
        ([{"role": "user", "content": "ok"}, "hello"], "messages[1]", "invalid_type"),
        ("hello", "messages", "invalid_type"),
        ([], "messages", "invalid_value"),
    ],
)
def test_bad_messages_are_400_naming_the_path(messages: Any, param: str, code: str) -> None:
    err = refused({"messages": messages})
    assert (err.param, err.code) == (param, code), err.message


def test_good_messages_reach_the_template_normalized() -> None:
    req = chat(
        [
            {"role": "developer", "content": "Be brief.", "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "refusal": "I can't."},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "refusal", "refusal": "B"}], "tool_calls": []},
            {"role": "user", "content": ""},
        ]
    )
    assert req.messages == (
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "Hello, there"},
        {"role": "assistant", "content": "I can't."},
        {"role": "assistant", "content": "AB"},
        {"role": "user", "content": ""},
    )
    text = tokenizer().render_chat(list(req.messages))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "developer" not in text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_unknown_field_is_400_naming_it(kind: str) -> None:
    base = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    err = refused({**base, "temprature": 0.5}, kind)
    assert (err.param, err.code) == ("temprature", "unknown_parameter")
    assert err.message == "Unrecognized request argument supplied: temprature"
    # a field of the other endpoint is unknown here too
    other = "echo" if kind == "chat" else "top_logprobs"
    assert refused({**base, other: 1}, kind).param == other
    for nested, param in (({"stream": True, "stream_options": {"include_usage": True, "x": 1}}), "stream_options.x"), (
        {"tidepool": {"trace": True, "debug": True}},
        "tidepool.debug",
    ):
        assert refused({**base, **nested}, kind).param == param


def test_tool_turns_reach_the_template() -> None:
    """Assistant tool calls and the tool messages answering them (any number, in order)
    are kept for the template, which renders them (Hermes for this ChatML model)."""
    second = {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    req = chat(
        [
            {"role": "user", "content": "x"},
            {**_CALL, "tool_calls": [*_CALL["tool_calls"], second]},
            {"role": "tool", "content": [{"type": "text", "text": "18C"}], "tool_call_id": "call_2"},
            {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        ]
    )
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [_CALL["tool_calls"][0], second]}
    assert req.messages[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_2"}
    from services.router.prepare import render_chat

    text = render_chat(tokenizer(), req.messages, None, None)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n18C\n</tool_response>" in text and "<tool_response>\nok\n</tool_response>" in text


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}]}, "functions", "conflicting_parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "function_call": "auto"}, "function_call", "conflicting_parameters"),
        ({"functions": [{"name": "f"}], "tool_choice": "auto"}, "tool_choice", "conflicting_parameters"),
        ({"tool_choice": "auto"}, "tool_choice", "conflicting_parameters"),
        ({"function_call": {"name": "f"}}, "function_call", "conflicting_parameters"),
        ({"tool_choice": 5}, "tool_choice", "invalid_type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice", "invalid_value"),
        ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call", "invalid_value"),
        ({"functions": [{"name": "f"}], "function_call": {"name": "f", "x": 1}}, "function_call.x", "unknown_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, "tool_choice.function", "missing_required_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x", "unknown_parameter"),
        ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", "missing_required_parameter"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict", "invalid_type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "invalid_value"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
        ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format.json_schema", "unknown_parameter"),
        ({"response_format": {}}, "response_format.type", "missing_required_parameter"),
        ({"response_format": {"type": "text", "strict": True}}, "response_format.strict", "unknown_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": ""}}}, "response_format.json_schema.name", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"description": 5}}}, "response_format.json_schema.description", "invalid_type"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_grammar"),
        ({"structured_outputs": {"regex": "a", "json_object": "yes"}}, "structured_outputs.json_object", "invalid_type"),
        ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}}, "structured_outputs.disable_additional_properties", "unsupported_parameter"),
        ({"guided_regex": "a", "grammar": "root ::= \"a\""}, "grammar", "conflicting_parameters"),
        ({"guided_json": 5}, "guided_json", "invalid_type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "conflicting_parameters"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
        ({"logit_bias": {"1": 101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"1": None}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"-1": 5}}, "logit_bias", "invalid_value"),
        ({"logit_bias": [1]}, "logit_bias", "invalid_type"),
    ],
)
def test_tools_constraints_and_extras_are_checked_naming_the_field(extra: dict[str, Any], param: str, code: str) -> None:
    err = refused({"messages": [{"role": "user", "content": "x"}], **extra})
    assert (err.param, err.code) == (param, code), err.message


def test_tool_fields_are_chat_only() -> None:
    for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
        err = refused({"prompt": "x", name: None}, "completion")
        assert (err.param, err.code) == (name, "unsupported_parameter")
    assert parse_request({"prompt": "x", "guided_regex": "a+"}, "completion", served_model=MODEL, vocab_size=49152).grammar.kind == "regex"


def test_tools_constraints_and_no_op_values_are_accepted() -> None:
    req = chat(
        [{"role": "user", "content": "x"}],
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        store=False,
        modalities=["text"],
        response_format={"type": "text"},
        logit_bias={},
        user="u-1",
    )
    assert req.user == "u-1" and req.tools is None and req.grammar is None and req.logit_bias == ()
    legacy = chat([{"role": "user", "content": "x"}], functions=[{"name": "f"}], function_call={"name": "f"})
    assert legacy.tools is not None and legacy.tools.choice == "named" and legacy.grammar is not None
    req = chat([{"role": "user", "content": "x"}], logit_bias={"007": 5.5, "12": -100}, response_format={"type": "json_object"})
    assert req.logit_bias == ((7, 5.5), (12, -100.0)) and req.grammar.kind == "json_object"
    so = chat([{"role": "user", "content": "x"}], structured_outputs={"choice": ["a"], "json_object": False, "disable_any_whitespace": True, "regex": None})
    assert so.grammar.kind == "choice"


def test_every_field_listed_is_read() -> None:
    """A listed field that the parser never reads would be silently ignored: each one
    given a value of the wrong type must be refused, naming it."""
    wrong = {"stream_options": 5, "tidepool": 5, "messages": 5, "prompt": {}, "guided_json": 5, "json_schema": 5}
    for kind, fields in (("chat", CHAT_FIELDS), ("completion", COMPLETION_FIELDS)):
        base = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
        for name in sorted(fields):
            body = {**base, "stream": True, name: wrong.get(name, {"not": "valid"})}
            err = refused(body, kind)
            assert err.param is not None and err.param.split(".")[0].split("[")[0] == name, (kind, name, err.message)


def test_integers_are_json_numbers_by_value() -> None:
    """``2.0`` is the integer 2 in JSON (and in JSON Schema, hence in /openapi.json)."""
    req = parse_request({"prompt": [1.0, 2], "n": 2.0, "max_tokens": 3.0, "stop_token_ids": [7.0]}, "completion", served_model=MODEL, vocab_size=49152)
    assert (req.prompts, req.n, req.max_tokens, req.stop_token_ids) == (((1, 2),), 2, 3, (7,))
    assert type(req.n) is int and all(type(t) is int for t in req.prompts[0])
    assert refused({"prompt": "x", "n": 2.5}, "completion").param == "n"
    assert refused({"prompt": [1.5]}, "completion").param == "prompt"


def test_a_prompt_the_vocabulary_cannot_spell_is_400_empty_prompt() -> None:
    """SmolLM2's byte-level vocabulary has no token for some bytes (0x06 among them): such
    a prompt tokenizes to nothing, a 400 the OpenAPI document cannot express."""
    from libs.structured import GrammarCompiler
    from services.router.prepare import prepare

    assert tokenizer().encode("\x06", add_special_tokens=False) == []
    with pytest.raises(ApiError) as exc:
        prepare(b'{"prompt": ["a", "\\u0006"]}', "completion", tokenizer=tokenizer(), served_model=MODEL, max_model_len=256, max_json_depth=8, grammars=GrammarCompiler(tokenizer()))
    assert (exc.value.param, exc.value.code) == ("prompt", "empty_prompt") and "prompt 1" in exc.value.message
