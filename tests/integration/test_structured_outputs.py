"""Structured outputs, tool calling and logit bias end to end: the official openai client,
through the router, on the real model, both through PD (chat prompts are long enough for
prefill, which samples the first token under the grammar) and with decode serving alone
(short completions prompts skip prefill). Every output must satisfy its constraint."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import openai
import pytest

from tests.integration.pd_helpers import TRACE, metric, metrics, trace_of, wait_until

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PERSON_CHAT = [{"role": "user", "content": "Describe a person as JSON with name, age and pet."}]
SHORT = "Person JSON:"  # a few tokens: decode serves it alone
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _decision(resp) -> str:
    return trace_of(resp)["prompts"][0]["prefill"]["decision"]


def _stream_texts(stream, chat: bool) -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
    return texts


def test_json_schema_through_pd(client, model):
    r = client.chat.completions.create(
        model=model, messages=PERSON_CHAT, n=10, temperature=1.0, seed=1, max_tokens=48,
        response_format=FORMAT, extra_body=TRACE,
    )
    assert _decision(r) == "prefill"
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model, messages=PERSON_CHAT, n=10, temperature=1.0, seed=2, max_tokens=48, response_format=FORMAT, stream=True
    )
    texts = _stream_texts(stream, chat=True)
    assert len(texts) == 10
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_decode_alone(client, model):
    body = {"structured_outputs": {"json": SCHEMA}, **TRACE}
    r = client.completions.create(model=model, prompt=SHORT, n=10, temperature=1.0, seed=3, max_tokens=48, extra_body=body)
    assert _decision(r) != "prefill"
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    stream = client.completions.create(
        model=model, prompt=SHORT, n=10, temperature=1.0, seed=4, max_tokens=48, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    )
    texts = _stream_texts(stream, chat=False)
    assert len(texts) == 10
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow  # ~20 s: make test-slow
def test_a_resumed_constrained_stream_rebuilds_its_grammar(cluster, client, model):
    """SIGKILL the decode serving a JSON-schema stream mid-way: the router resumes it on
    another decode, which replays the tokens so far into a fresh grammar state; the client
    sees one unbroken text, equal to an unbroken greedy run and valid against the schema."""
    ask = dict(model=model, messages=PERSON_CHAT, temperature=0, max_tokens=64, response_format=FORMAT)
    expected = client.chat.completions.create(**ask).choices[0].message.content
    jsonschema.validate(json.loads(expected), SCHEMA)

    def usable_decodes() -> list[str]:
        return sorted(w["id"] for w in cluster.workers() if w["role"] == "decode" and w["usable"])

    extra = cluster._worker("decode", 1, cluster.url)  # a second decode, for this test only
    decodes = {"decode-0": cluster.decodes[0], "decode-1": extra}
    killed = None
    try:
        extra.start()
        extra.wait_ready(180)
        wait_until(lambda: usable_decodes() == ["decode-0", "decode-1"], 30, "two usable decodes")
        before = metric(metrics(cluster.url), "tidepool_router_decode_resumptions_total")
        text, trace = [], None
        for chunk in client.chat.completions.create(**ask, stream=True, extra_body=TRACE):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if killed is None and len(text) >= 6:  # decode is generating: kill the one serving it
                serving = [w["id"] for w in cluster.workers() if w["role"] == "decode" and w["router_in_flight"]]
                assert len(serving) == 1, cluster.workers()
                killed = serving[0]
                decodes[killed].kill()
            trace = (chunk.model_extra or {}).get("tidepool", {}).get("trace", trace)
        assert killed is not None, "the stream ended before decode could be killed"
        assert "".join(text) == expected
        jsonschema.validate(json.loads("".join(text)), SCHEMA)
        attempts = trace["prompts"][0]["choices"][0]["attempts"]
        assert [a["instance"] for a in attempts][0] == killed and attempts[-1]["instance"] != killed
        assert attempts[-1]["tokens_before"] >= 5 and attempts[-1]["outcome"] == "stop"
        assert metric(metrics(cluster.url), "tidepool_router_decode_resumptions_total") == before + 1
    finally:
        extra.stop()
        if killed == "decode-0":  # the launcher's supervisor restarts the shared decode
            wait_until(lambda: usable_decodes() == ["decode-0"], 240, "decode-0 back")


def test_regex_and_choice(client, model):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    r = client.completions.create(
        model=model, prompt="Name and age:", n=4, temperature=1.0, seed=5, max_tokens=16,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Classify the sentiment of: I love this sunny day at the beach."}],
        n=4, temperature=1.0, seed=6, max_tokens=8, extra_body={"structured_outputs": {"choice": choices}, **TRACE},
    )
    assert _decision(r) == "prefill"
    assert all(c.message.content in choices for c in r.choices)


def test_named_tool_choice_always_calls_it(client, model):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], n=3, temperature=1.0, seed=7, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The call and its result go back into the history.
    call = r.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, tools=[WEATHER],
        messages=messages + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
        ],
    )
    assert follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls


def test_streamed_tool_call_arrives_argument_by_argument(client, model):
    """The official client's streaming helper accumulates the deltas into exactly the
    non-streamed call; the arguments arrive in many deltas, after a header delta."""
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": "What is the weather like in Oslo?"}], tools=[WEATHER],
        temperature=0, max_tokens=48, tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    chunks = [e.chunk for e in events if e.type == "chunk"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    head, *rest = deltas
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert len([e for e in events if e.type == "tool_calls.function.arguments.delta"]) > 3


def test_auto_tool_choice_is_text_or_a_valid_call(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome? Use the tool."}], tools=[WEATHER],
        n=3, temperature=1.0, seed=9, max_tokens=48,
    )
    for c in r.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                assert call.function.name == "get_weather"
                json.loads(call.function.arguments)
        else:
            assert isinstance(c.message.content, str) and "<tool_call>" not in c.message.content or c.finish_reason == "length"


def test_logit_bias_bans_and_forces(client, model):
    messages = [{"role": "user", "content": "Say hello."}]
    base = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6, logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    tok_id = client.post("/../tokenize", body={"prompt": first, "add_special_tokens": False}, cast_to=object)["tokens"]
    assert len(tok_id) == 1
    banned = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=6, logprobs=True, logit_bias={str(tok_id[0]): -100}
    )
    assert first not in [t.token for t in banned.choices[0].logprobs.content]
    forced = client.completions.create(model=model, prompt="Hi", temperature=0, max_tokens=4, logit_bias={"1234": 100}, extra_body=TRACE)
    detok = client.post("/../detokenize", body={"tokens": [1234] * 4}, cast_to=object)["prompt"]
    assert forced.choices[0].text == detok


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "([a-z]"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "structured_outputs.grammar"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"minimum": "a"}}}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18C"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_bad_constraints_and_tools_are_400(client, model, kwargs, param):
    kwargs = dict(kwargs)
    messages = kwargs.pop("messages", PERSON_CHAT)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, **kwargs)
    assert e.value.param == param
    assert client.chat.completions.create(model=model, messages=PERSON_CHAT, max_tokens=1).choices  # still serving
