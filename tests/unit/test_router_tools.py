"""Tool calling and the utility endpoints on the router's side: the Hermes parser (whole and
incremental), the grammar that forces a call, request parsing, /tokenize and /detokenize."""

from __future__ import annotations

import json
import random
from typing import AsyncIterator

import pytest

from libs.structured import GrammarCompiler, GrammarMismatchError
from services.router.constraints import parse_constraint
from services.router.errors import ApiError
from services.router.tool_parser import HermesToolParser
from services.router.tools import parse_tools
from tests.router_harness import MODEL, Cluster, start_cluster, tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
OUTPUT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _run(parser: HermesToolParser, pieces: list[str]):
    content, calls = "", []
    for p in pieces:
        out = parser.feed(p)
        content += out.content
        calls += out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


def test_parser_whole_and_split_anywhere():
    want_content, want_calls = _run(HermesToolParser(["get_weather", "get_time"]), [OUTPUT])
    assert want_content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in want_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [c.index for c in want_calls] == [0, 1]
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), 6))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        content, calls = _run(HermesToolParser(["get_weather", "get_time"]), pieces)
        assert content == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
        "a < b, and <tool_ca",
    ],
)
def test_invalid_calls_stay_text(text):
    content, calls = _run(HermesToolParser(["get_time"]), [text])
    assert calls == [] and content == text


def test_unclosed_call_with_complete_json_counts():
    content, calls = _run(HermesToolParser(["get_time"]), ['<tool_call>\n{"name": "get_time", "arguments": {}}\n'])
    assert len(calls) == 1 and content == ""


def test_streamed_deltas_are_openai_shaped():
    (call,) = _run(HermesToolParser(["get_time"]), ['<tool_call>{"name": "get_time", "arguments": {"a": 1}}</tool_call>'])[1]
    head, args = call.deltas()
    assert head["id"].startswith("call_") and head["type"] == "function" and head["function"] == {"name": "get_time", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"a": 1}'}}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tokenizer())


@pytest.mark.parametrize("parallel", [True, False])
def test_required_grammar_forces_valid_calls(compiler, parallel):
    tok = tokenizer()
    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": parallel})
    compiled = compiler.compile(req.constraint())
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    m = compiled.matcher()
    m.replay(tok.encode(one, add_special_tokens=False))
    assert m.is_accepting
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    m = compiled.matcher()
    if parallel:
        m.replay(tok.encode(two, add_special_tokens=False))
        assert m.is_accepting
    else:
        with pytest.raises(GrammarMismatchError):
            m.replay(tok.encode(two, add_special_tokens=False))
    for bad in ['<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', "Sure! " + one,
                '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>']:
        with pytest.raises(GrammarMismatchError):
            compiled.matcher().replay(tok.encode(bad, add_special_tokens=False) + list(tok.eos_token_ids))


def test_named_grammar_allows_only_that_function(compiler):
    tok = tokenizer()
    req = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    compiled = compiler.compile(req.constraint())
    compiled.matcher().replay(tok.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', add_special_tokens=False))
    with pytest.raises(GrammarMismatchError):
        compiled.matcher().replay(tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}', add_special_tokens=False))


def test_parse_tools_and_constraints():
    assert parse_tools({}) is None
    assert parse_tools({"tools": [TIME], "tool_choice": "none"}).active is False
    auto = parse_tools({"functions": [{"name": "f"}], "function_call": "auto"})
    assert auto.choice == "auto" and auto.constraint() is None and auto.tools[0].name == "f"
    assert parse_constraint({"response_format": {"type": "text"}}) is None
    c = parse_constraint({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}})
    assert c.spec.kind == "json_schema" and c.spec.strict
    assert parse_constraint({"guided_choice": ["a", "b"]}).spec.kind == "choice"
    assert parse_constraint({"json_schema": {"type": "object"}}).param == "json_schema"
    assert parse_constraint({"structured_outputs": {"json_object": True}}).spec.kind == "json_object"
    for body, param in [
        ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}}, "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": {"regex": "a", "nope": 1}}, "structured_outputs.nope"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}, "response_format.json_schema.extra"),
    ]:
        with pytest.raises(ApiError) as e:
            parse_constraint(body)
        assert e.value.param == param


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster()
    yield c
    await c.close()


async def test_tokenize_and_detokenize(cluster: Cluster):
    http = cluster.http()
    tok = tokenizer()
    async with http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}) as r:
        body = await r.json()
    assert r.status == 200 and body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]] and body["max_model_len"] > 0
    chat = [{"role": "user", "content": "Hi"}]
    async with http.post("/tokenize", json={"messages": chat}) as r:
        body = await r.json()
    assert body["tokens"] == tok.encode_chat(chat)
    async with http.post("/detokenize", json={"tokens": body["tokens"]}) as r:
        assert (await r.json())["prompt"] == tok.decode(body["tokens"])
    for path, bad, param in [
        ("/tokenize", {"prompt": "x", "messages": chat}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        async with http.post(path, json=bad) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param, bad


async def test_tokenize_chat_form_tools_and_generation_prompt(cluster: Cluster):
    """The chat form renders as a chat completion would (tools shown through the Hermes
    template, tool turns checked), and honours add_generation_prompt and add_special_tokens."""
    http = cluster.http()
    tok = tokenizer()
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    async with http.post("/tokenize", json={"messages": chat, "tools": [WEATHER]}) as r:
        with_tools = (await r.json())["tokens"]
    assert r.status == 200 and '"get_weather"' in tok.decode(with_tools) and "<tools>" in tok.decode(with_tools)
    async with http.post("/tokenize", json={"messages": chat, "add_generation_prompt": False}) as r:
        body = await r.json()
    assert body["tokens"] == tok.encode_chat(chat, add_generation_prompt=False)
    for bad, param, code in [
        ({"messages": chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools[0].function.parameters", "invalid_grammar"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": chat, "continue_final_message": True}, "continue_final_message", "unsupported_parameter"),
        ({"messages": chat, "add_special_tokens": "yes"}, "add_special_tokens", "invalid_type"),
        ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unknown_parameter"),
        ({"model": "gpt-4", "prompt": "x"}, "model", "model_not_found"),
        ({}, "prompt", "missing_required_parameter"),
    ]:
        async with http.post("/tokenize", json=bad) as r:
            error = (await r.json())["error"]
            assert r.status in (400, 404) and (error["param"], error["code"]) == (param, code), bad
    async with http.post("/detokenize", json={}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"


async def test_tokenize_is_bounded_and_keyed_like_the_generation_endpoints():
    c = await start_cluster(max_body_bytes=1000, max_json_depth=8, api_key="k")
    try:
        async with c.http() as http:
            headers = {"Authorization": "Bearer k"}
            for path in ("/tokenize", "/detokenize"):
                async with http.post(path, json={"prompt": "x", "tokens": [1]}) as r:
                    assert r.status == 401  # behind the API key, as /v1/ is
                async with http.post(path, data=b'{"prompt": "' + b"a" * 1000 + b'"}', headers=headers) as r:
                    assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
                async with http.post(path, data=b"[" * 20 + b"]" * 20, headers=headers) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "json_too_deep"
                async with http.post(path, data=b"{oops", headers=headers) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "malformed_json"
            async with http.post("/tokenize", json={"prompt": "Hello"}, headers=headers) as r:
                assert r.status == 200 and (await r.json())["tokens"] == tokenizer().encode("Hello")
    finally:
        await c.close()
