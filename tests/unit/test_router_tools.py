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
