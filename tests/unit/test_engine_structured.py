"""Structured outputs and logit bias through the engine on the real SmolLM2: every sampled
output follows its grammar, a continuation from a replayed prefix (the PD handoff) does
too, and bad input is refused before anything is queued."""

from __future__ import annotations

import json

import jsonschema
import pytest

from libs.engine import SamplingParams, TokenOutOfRangeError
from libs.structured import GrammarMismatchError, GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Name a city and its population, as JSON."}]


def test_json_schema_samples_validate(engine):
    results = engine.generate(
        messages=CHAT,
        params=SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=40),
        grammar=GrammarSpec.json_schema(SCHEMA),
    )
    assert len(results) == 4
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_choice_and_complete_grammar_stops(engine):
    choices = ["red", "green", "blue"]
    results = engine.generate(
        messages=[{"role": "user", "content": "Pick a colour."}],
        params=SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        grammar=GrammarSpec.choice(choices),
    )
    for r in results:
        assert r.text in choices and r.finish_reason == "stop"


def test_continuation_from_replayed_prefix(engine):
    """PD: prefill sampled a first token under the grammar; decode replays it into a fresh
    state and continues; the whole output is valid."""
    spec = GrammarSpec.json_schema(SCHEMA)
    ids = engine.tokenizer.encode_chat(CHAT)
    first = engine.generate(ids, SamplingParams(temperature=1.0, seed=11, max_tokens=1), grammar=spec)[0].token_ids
    head, text = engine.tokenizer.decode(first), '{"city": "Oslo", '
    assert text.startswith(head)  # '{' or '{"': the schema allows nothing else first
    prefix = first + engine.tokenizer.encode(text[len(head):], add_special_tokens=False)
    grammar = engine.start_grammar(spec, prefix)
    engine.add_request("resume", ids, SamplingParams(temperature=1.0, seed=5, max_tokens=30), output_prefix=prefix, grammar=grammar)
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            for c in o.outputs:
                out += c.new_token_ids
    doc = json.loads(engine.tokenizer.decode(prefix + out))
    jsonschema.validate(doc, SCHEMA)
    assert doc["city"] == "Oslo"
    with pytest.raises(GrammarMismatchError):
        engine.start_grammar(spec, engine.tokenizer.encode("[1]", add_special_tokens=False))


def test_logit_bias_out_of_vocabulary_is_refused(engine):
    with pytest.raises(TokenOutOfRangeError, match="logit_bias"):
        engine.validate([1, 2, 3], SamplingParams(logit_bias={engine.vocab_size: 5}))


def test_greedy_ban_and_force(engine):
    ids = engine.tokenizer.encode_chat(CHAT)
    base = engine.generate(ids, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    banned = engine.generate(ids, SamplingParams(temperature=0, max_tokens=4, logit_bias={base[0]: -100}))[0].token_ids
    assert base[0] not in banned
    forced = engine.generate(ids, SamplingParams(temperature=0, max_tokens=3, logit_bias={1234: 100}))[0].token_ids
    assert forced == [1234] * 3
