"""Tool calling and the utility endpoints on the router's side: the Hermes parser (whole and
incremental), the grammar that forces a call, request parsing, /tokenize and /detokenize."""

from __future__ import annotations

import json
import random
from typing import AsyncIterator

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from libs.structured import GrammarCompiler, GrammarMismatchError
from services.router.api import parse_request
from services.router.constraints import parse_constraint
from services.router.errors import ApiError
from services.router.handoff import ChoiceUpdate
from services.router.responses import Formatter
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


def test_whole_call_deltas_are_openai_shaped():
    parser = HermesToolParser(["get_time"])
    out = parser.feed('<tool_call>{"name": "get_time", "arguments": {"a": 1}}</tool_call>')
    head, args = out.deltas
    (h,) = head["tool_calls"]
    assert h["id"].startswith("call_") and h["type"] == "function" and h["function"] == {"name": "get_time", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}


def _stream(pieces: list[str], names=("get_weather", "get_time")):
    """Stream ``pieces`` through a streaming parser; (content, {index: [name, id, arguments]},
    the deltas per piece)."""
    parser = HermesToolParser(names, stream=True)
    content, calls, per_piece = "", {}, []
    for out in [*(parser.feed(p) for p in pieces), parser.finish()]:
        per_piece.append(out.deltas)
        for d in out.deltas:
            if "content" in d:
                content += d["content"]
                continue
            (t,) = d["tool_calls"]
            if "id" in t:
                assert t.keys() == {"index", "id", "type", "function"} and t["function"]["arguments"] == ""
                assert t["index"] not in calls, "a call's header is sent once"
                calls[t["index"]] = [t["function"]["name"], t["id"], ""]
            else:
                assert t.keys() == {"index", "function"} and t["function"].keys() == {"arguments"}
                calls[t["index"]][2] += t["function"]["arguments"]
    assert [[c.name, c.id, c.arguments] for c in parser.calls] == [calls[i] for i in sorted(calls)]
    return content, calls, per_piece


def test_streamed_calls_equal_the_whole_ones_split_anywhere():
    whole_content, whole = _run(HermesToolParser(["get_weather", "get_time"]), [OUTPUT])
    rng = random.Random(1)
    for trial in range(60):
        k = 1 if trial == 0 else rng.randint(2, 40)
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), k - 1)) if k > 1 else []
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        content, calls, _ = _stream(pieces)
        assert content.strip() == whole_content.strip()
        assert [(name, args) for name, _, args in calls.values()] == [(c.name, c.arguments) for c in whole]


def test_streamed_arguments_arrive_as_they_are_generated():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is", "n": [1, {"x": "}"}]}}\n</tool_call>'
    _, calls, per_piece = _stream(list(text))  # one character at a time
    (name, _, args), = calls.values()
    assert name == "get_weather" and json.loads(args) == {"city": 'Par"is', "n": [1, {"x": "}"}]}
    header_at = next(i for i, ds in enumerate(per_piece) if any("id" in d.get("tool_calls", [{}])[0] for d in ds))
    assert header_at == text.index('"get_weather"') + len('"get_weather"') - 1  # as soon as the name is complete
    pieces = [i for i, ds in enumerate(per_piece) if any("id" not in d.get("tool_calls", [{"id": 0}])[0] for d in ds)]
    assert len(pieces) == len(args) and pieces[-1] < text.index("</tool_call>")  # character by character, before the tag


def test_streamed_arguments_before_name_and_missing_arguments():
    _, calls, _ = _stream(['<tool_call>{"arguments": {"city": "Oslo"},', ' "name": "get_weather"}</tool_call>'])
    assert [(n, a) for n, _, a in calls.values()] == [("get_weather", '{"city": "Oslo"}')]
    _, calls, _ = _stream(['<tool_call>{"name": "get_time"', "}</tool_call>"])
    assert [(n, a) for n, _, a in calls.values()] == [("get_time", "{}")]


@pytest.mark.parametrize(
    "text",
    ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', "<tool_call>\nnot json\n</tool_call>", "a < b, and <tool_ca"],
)
def test_streamed_non_calls_stay_text(text):
    for pieces in ([text], list(text)):
        content, calls, _ = _stream(pieces, names=["get_time"])
        assert calls == {} and content == text


def _formatter(stream: bool) -> Formatter:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], "stream": stream}
    return Formatter(parse_request(body, "chat", served_model=MODEL, vocab_size=tokenizer().vocab_size), "chatcmpl-t", 0, [""])


def test_streamed_chunks_accumulate_in_the_openai_client_to_the_whole_response():
    """The official client's own accumulator (what ``client.chat.completions.stream``
    uses) rebuilds the streamed chunks into the same message as the whole response."""
    whole = _formatter(stream=False)
    whole.choices[0].add(ChoiceUpdate(0, OUTPUT, num_tokens=40, finish_reason="stop"))
    want = whole.response({}, None)["choices"][0]
    rng = random.Random(2)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), 30))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        streamed = _formatter(stream=True)
        state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
        events = []
        for k, piece in enumerate(pieces):
            update = ChoiceUpdate(0, piece, num_tokens=1, finish_reason="stop" if k == len(pieces) - 1 else None)
            for chunk in streamed.chunks(update):
                events += [e.type for e in state.handle_chunk(ChatCompletionChunk.model_validate(chunk))]
        got = state.get_final_completion().choices[0]
        assert got.finish_reason == want["finish_reason"] == "tool_calls"
        # (a stream sends the space before a call before it knows a call follows)
        assert got.message.content.strip() == want["message"]["content"] == "Let me check."
        calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls]
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in want["message"]["tool_calls"]]
        assert events.count("tool_calls.function.arguments.delta") > 2  # arguments arrived in pieces
        assert events.count("tool_calls.function.arguments.done") == 2


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
