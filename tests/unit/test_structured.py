"""Structured outputs' engine-side pieces (libs/engine/structured) on the real SmolLM2
tokenizer: compiling and caching, masks that allow exactly what the grammar allows,
replay, forks, batched fills, and errors that name the problem."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from libs.structured import GrammarError, GrammarMismatchError, GrammarSpec
from libs.structured.bitmask import BitmaskFiller
from kernels.bitmask.reference import unpack_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}


def _allowed(matcher, vocab: int) -> torch.Tensor:
    bm = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    matcher.fill(bm, 0)
    return unpack_bitmask(bm, vocab)[0]


def test_valid_output_is_allowed_token_by_token(grammar_compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = grammar_compiler.compile(GrammarSpec.json_schema(PERSON)).matcher()
    text = json.dumps({"name": "Ada", "age": 36, "member": True, "tier": "gold"})
    specials = [s for s in tok.special_ids if s not in tok.eos_token_ids]
    for t in tok.encode(text, add_special_tokens=False):
        allowed = _allowed(m, tok.vocab_size)
        assert allowed[t]
        assert not allowed[specials].any(), "a special token is allowed inside the JSON"
        assert not allowed[tok.eos_token_ids[0]], "EOS before the object is complete"
        assert m.accept(t)
    assert m.is_accepting
    allowed = _allowed(m, tok.vocab_size)
    assert allowed[tok.eos_token_ids[0]] and int(allowed.sum()) == 1  # only EOS may follow
    assert m.accept(tok.eos_token_ids[0]) and m.is_terminated


def test_layout_is_compact_and_canonical(grammar_compiler, smollm2_tokenizer):
    """No free whitespace: a newline after '{' is not allowed, ': ' after keys is."""
    tok = smollm2_tokenizer
    m = grammar_compiler.compile(GrammarSpec.json_schema(PERSON)).matcher()
    m.accept(tok.encode("{", add_special_tokens=False)[0])
    allowed = _allowed(m, tok.vocab_size)
    assert not allowed[tok.encode("\n", add_special_tokens=False)[0]]
    assert not allowed[tok.encode(" ", add_special_tokens=False)[0]]


def test_random_walks_produce_valid_json(grammar_compiler, smollm2_tokenizer):
    """Sampling uniformly among allowed tokens (EOS as soon as allowed) always ends in a
    document the schema accepts: the mask, not the model, guarantees validity."""
    tok = smollm2_tokenizer
    compiled = grammar_compiler.compile(GrammarSpec.json_schema(PERSON))
    eos = tok.eos_token_ids[0]
    for seed in range(5):
        rng = random.Random(seed)
        m = compiled.matcher()
        out = []
        for _ in range(200):
            allowed = _allowed(m, tok.vocab_size)
            if allowed[eos]:
                break
            t = rng.choice(allowed.nonzero().flatten().tolist())
            assert m.accept(t)
            out.append(t)
        doc = json.loads(tok.decode(out))
        jsonschema.validate(doc, PERSON)


@pytest.mark.parametrize(
    "spec,good,bad",
    [
        (GrammarSpec("regex", r"[0-9]{3}-[a-z]+"), "123-abc", "12a"),
        (GrammarSpec.choice(["red apple", "green pear"]), "green pear", "blue"),
        (GrammarSpec("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), "(1+22)", "(1+)"),
        (GrammarSpec("json_object"), '{"a": [1, 2]}', "[1]"),
    ],
)
def test_other_kinds(grammar_compiler, smollm2_tokenizer, spec, good, bad):
    tok = smollm2_tokenizer
    compiled = grammar_compiler.compile(spec)
    m = compiled.matcher()
    m.replay(tok.encode(good, add_special_tokens=False))
    assert m.is_accepting
    m2 = compiled.matcher()
    with pytest.raises(GrammarMismatchError):
        m2.replay(tok.encode(bad, add_special_tokens=False) + [tok.eos_token_ids[0]])


def test_cache_is_keyed_by_canonical_spec(grammar_compiler):
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GrammarSpec.json_schema('{"type": "object",\n  "properties": {"x": {"type":   "integer"}}}')
    assert a == b
    first = grammar_compiler.compile(a)
    hits = grammar_compiler.hits
    assert grammar_compiler.compile(b) is first and grammar_compiler.hits == hits + 1
    assert grammar_compiler.compile(GrammarSpec.json_schema(a.value, strict=True)) is not first


def test_cache_is_bounded(smollm2_tokenizer, grammar_compiler):
    from libs.structured import GrammarCompiler

    small = GrammarCompiler(smollm2_tokenizer, cache_size=2)
    small._ll_tokenizer = grammar_compiler.ll_tokenizer()  # skip re-indexing the vocabulary
    for i in range(4):
        small.compile(GrammarSpec("regex", f"a{{{i + 1}}}"))
    assert len(small) == 2 and small.misses == 4


@pytest.mark.parametrize(
    "spec,problem",
    [
        (lambda: GrammarSpec.json_schema({"type": "foo"}), "Invalid type: foo"),
        (lambda: GrammarSpec.json_schema({"type": "string", "minLength": "x"}), "minLength"),
        (lambda: GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/nope"}}}), "/nope"),
        (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
        (lambda: GrammarSpec.json_schema({"type": "string", "format": "weird"}, strict=True), "Unknown format: weird"),
        (lambda: GrammarSpec("regex", "a(b"), "unclosed group"),
        (lambda: GrammarSpec("grammar", 'root ::= "a" | missing'), "missing"),
        (lambda: GrammarSpec.choice([]), "non-empty"),
    ],
)
def test_bad_specs_name_the_problem(grammar_compiler, spec, problem):
    with pytest.raises(GrammarError) as e:
        grammar_compiler.compile(spec())
    assert problem in str(e.value)


def test_lenient_ignores_unknown_keywords(grammar_compiler):
    grammar_compiler.compile(GrammarSpec.json_schema({"type": "string", "format": "weird"}, strict=False))


def test_copies_are_independent(grammar_compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = grammar_compiler.compile(GrammarSpec.choice(["yes", "no"])).matcher()
    c = m.copy()
    assert m.accept(tok.encode("yes", add_special_tokens=False)[0])
    assert c.accept(tok.encode("no", add_special_tokens=False)[0])
    assert m.is_accepting and c.is_accepting


def test_rollback_undoes_tokens(grammar_compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = grammar_compiler.compile(GrammarSpec("regex", "abc|abd")).matcher()
    before = _allowed(m, tok.vocab_size).clone()
    m.replay(tok.encode("ab", add_special_tokens=False))
    m.rollback(m.num_accepted)
    assert torch.equal(_allowed(m, tok.vocab_size), before)


def test_batched_fill_equals_single_fills(grammar_compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    specs = [GrammarSpec.json_schema(PERSON), GrammarSpec("regex", "[a-z]+@[a-z]+"), GrammarSpec.choice(["one", "two"])]
    matchers = []
    for i in range(9):
        m = grammar_compiler.compile(specs[i % 3]).matcher()
        if i % 3 == 0 and i:
            m.replay(tok.encode('{"name": "', add_special_tokens=False))
        matchers.append(m)
    filler = BitmaskFiller(tok.vocab_size, threads=2)
    try:
        batched = filler.submit(matchers).result()
        for i, m in enumerate(matchers):
            single = torch.zeros((1, batched.shape[1]), dtype=torch.int32)
            m.fill(single, 0)
            assert torch.equal(batched[i], single[0])
        assert filler.rows_filled == 9 and filler.steps == 1
    finally:
        filler.close()


def test_replay_past_the_end_is_refused(grammar_compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = grammar_compiler.compile(GrammarSpec.choice(["yes"])).matcher()
    with pytest.raises(GrammarMismatchError, match="after the output is complete"):
        m.replay(tok.encode("yes", add_special_tokens=False) + [tok.eos_token_ids[0], 100])
