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
        ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls", "unsupported_parameter"),
        ([{"role": "assistant", "content": "x", "function_call": {"name": "f"}}], "messages[0].function_call", "unsupported_parameter"),
        ([{"role": "tool", "content": "42", "tool_call_id": "call_1"}], "messages[0].role", "unsupported_value"),
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


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "text", "strict": True}}, "response_format.strict"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_unsupported_chat_fields_are_refused_naming_them(extra: dict[str, Any], param: str) -> None:
    assert refused({"messages": [{"role": "user", "content": "x"}], **extra}).param == param


def test_unsupported_fields_at_their_no_op_value_are_accepted() -> None:
    req = chat(
        [{"role": "user", "content": "x"}],
        tools=[],
        functions=[],
        tool_choice="none",
        function_call="none",
        parallel_tool_calls=False,
        store=False,
        modalities=["text"],
        response_format={"type": "text"},
        logit_bias={},
        user="u-1",
    )
    assert req.user == "u-1"


def test_every_field_listed_is_read() -> None:
    """A listed field that the parser never reads would be silently ignored: each one
    given a value of the wrong type must be refused, naming it."""
    wrong = {"stream_options": 5, "tidepool": 5, "messages": 5, "prompt": {}}
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
