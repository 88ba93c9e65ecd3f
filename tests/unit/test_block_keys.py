"""Properties of the chained block keys (libs/blocks/keys.py) that the pool relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.blocks.keys import BlockKey, Namespace, block_keys, full_block_keys

BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 8, 16])
TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=80)
MODELS = st.text(alphabet="abcdef0123456789", min_size=1, max_size=16)


def ns_for(block_size: int, model: str = "m0") -> Namespace:
    return Namespace(model_digest=model, dtype="bf16", block_size=block_size)


@given(BLOCK_SIZES, TOKENS)
def test_writer_and_reader_compute_the_same_keys(block_size: int, tokens: list[int]) -> None:
    # The writer holds a list, the reader may hold a tuple or an array; the keys must agree.
    ns_w, ns_r = ns_for(block_size), ns_for(block_size)
    writer = block_keys(ns_w, tokens)
    assert block_keys(ns_r, tuple(tokens)) == writer
    assert block_keys(ns_r, array("I", tokens)) == writer
    assert len(writer) == -(-len(tokens) // block_size)


def test_keys_do_not_depend_on_the_process() -> None:
    # Python's hash() is salted per process; keys must be identical in any other process.
    tokens = list(range(1, 40))
    here = [str(k) for k in block_keys(ns_for(16), tokens)]
    code = (
        "import json; from libs.blocks.keys import Namespace, block_keys;"
        "ns = Namespace(model_digest='m0', dtype='bf16', block_size=16);"
        f"print(json.dumps([str(k) for k in block_keys(ns, {tokens!r})]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == here


@given(BLOCK_SIZES, st.lists(st.integers(0, 50_000), min_size=1, max_size=80), st.data())
def test_changed_token_changes_every_later_key_only(block_size: int, tokens: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1), label="changed position")
    changed = list(tokens)
    changed[i] = tokens[i] + 1
    ns = ns_for(block_size)
    before, after = block_keys(ns, tokens), block_keys(ns, changed)
    first_changed = i // block_size
    assert before[:first_changed] == after[:first_changed]
    for b, a in zip(before[first_changed:], after[first_changed:]):
        assert b.digest != a.digest


@given(BLOCK_SIZES, st.lists(st.integers(0, 50_000), min_size=1, max_size=64), MODELS, MODELS)
def test_changed_model_changes_every_key(block_size: int, tokens: list[int], m1: str, m2: str) -> None:
    if m1 == m2:
        m2 = m1 + "x"
    a, b = block_keys(ns_for(block_size, m1), tokens), block_keys(ns_for(block_size, m2), tokens)
    assert all(x.digest != y.digest for x, y in zip(a, b))


@given(st.lists(st.integers(0, 50_000), min_size=8, max_size=64), st.sampled_from([(2, 4), (4, 8), (8, 4), (1, 2)]))
def test_changed_block_size_changes_every_key(tokens: list[int], sizes: tuple[int, int]) -> None:
    a, b = block_keys(ns_for(sizes[0]), tokens), block_keys(ns_for(sizes[1]), tokens)
    digests_a = {k.digest for k in a}
    assert not digests_a & {k.digest for k in b}


@given(BLOCK_SIZES, TOKENS, st.lists(st.integers(0, 50_000), min_size=1, max_size=40))
def test_partial_tail_is_never_a_parent(block_size: int, tokens: list[int], extension: list[int]) -> None:
    ns = ns_for(block_size)
    short, longer = block_keys(ns, tokens), block_keys(ns, tokens + extension)
    n_full = len(tokens) // block_size
    # Full blocks are shared by every extension of the prompt ...
    assert longer[:n_full] == short[:n_full]
    assert full_block_keys(ns, tokens) == [k.digest for k in short[:n_full]]
    if len(short) > n_full:
        tail = short[-1]
        assert tail.partial and 0 < tail.num_tokens < block_size
        assert str(tail).endswith(f":partial:{tail.num_tokens}")
        # ... but the partial tail is not: no key of the longer prompt reuses or descends from it.
        assert tail not in longer
        assert all(k.digest != tail.digest for k in longer)
        # The block that replaced the tail in the longer prompt hashes from the last full key.
        assert longer[n_full].digest != tail.digest


@given(BLOCK_SIZES, TOKENS)
def test_str_parse_roundtrip(block_size: int, tokens: list[int]) -> None:
    for key in block_keys(ns_for(block_size), tokens):
        assert BlockKey.parse(str(key), block_size) == key


@settings(max_examples=25)
@given(BLOCK_SIZES)
def test_empty_prompt_has_no_keys(block_size: int) -> None:
    assert block_keys(ns_for(block_size), []) == []


def test_namespace_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Namespace(model_digest="", dtype="bf16", block_size=16)
    with pytest.raises(ValueError):
        Namespace(model_digest="m", dtype="bf16", block_size=0)


@given(BLOCK_SIZES, TOKENS, st.data())
def test_chain_keys_of_a_range_equal_chain_key_block_by_block(block_size: int, tokens: list[int], data: st.DataObject) -> None:
    """``chain_keys`` (the prefix cache's batched form: one conversion to bytes, a copied
    personalised hasher) continues a chain exactly as ``chain_key`` does one block at a time."""
    from libs.blocks.keys import chain_key, chain_keys

    n_full = len(tokens) // block_size
    first = data.draw(st.integers(0, n_full))
    stop = data.draw(st.integers(first, n_full))
    parent = ns_for(block_size).digest
    expected = []
    for i in range(stop):
        parent = chain_key(parent, tokens[i * block_size : (i + 1) * block_size])
        expected.append(parent)
    start_parent = expected[first - 1] if first else ns_for(block_size).digest
    assert chain_keys(start_parent, tokens, block_size, first, stop) == expected[first:stop]
    with pytest.raises(ValueError):
        chain_keys(b"short", tokens, block_size, first, stop)
