"""Token-id prompts in the router (services/router/api.py, body.py): the C-speed path for
arrays of exact ints gives what the per-id check gives, and everything else still gets the
per-id check and its message."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from services.router.api import _prompts, token_ids
from services.router.body import parse_json
from services.router.errors import ApiError

VOCAB = 1000
ints = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-2, -1, 0, VOCAB - 1, VOCAB, VOCAB + 1]))
ids = st.one_of(ints, st.sampled_from([2.0, 3.5, True, None, "7"]))


def expected(value: list) -> tuple[int, ...] | str:
    """The per-id rules: an int or an integral float in [0, VOCAB), else the first bad index."""
    out = []
    for i, v in enumerate(value):
        if type(v) is int or (type(v) is float and v.is_integer()):
            if not 0 <= int(v) < VOCAB:
                return f"prompt[{i}]"
            out.append(int(v))
        else:
            return f"prompt[{i}]"
    return tuple(out)


@given(st.one_of(st.lists(ints, min_size=1, max_size=40), st.lists(ids, min_size=1, max_size=40)))
def test_token_ids_follow_the_per_id_rules(value: list) -> None:
    want = expected(value)
    if isinstance(want, tuple):
        got = token_ids(value, "prompt", VOCAB)
        assert got == want and all(type(t) is int for t in got)
    else:
        with pytest.raises(ApiError) as e:
            token_ids(value, "prompt", VOCAB)
        assert e.value.status == 400 and f"'{want}'" in str(e.value)


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3000))
def test_a_long_id_prompt_parses_whole(value: list[int]) -> None:
    body = parse_json(json.dumps({"prompt": value}).encode(), max_depth=8)
    assert _prompts(body["prompt"], VOCAB) == (tuple(value),)


def test_deep_bodies_are_still_refused_beside_flat_arrays() -> None:
    with pytest.raises(ApiError) as e:
        parse_json(json.dumps({"prompt": list(range(100)), "x": [[[[[[1]]]]]]}).encode(), max_depth=4)
    assert e.value.code == "json_too_deep"
    with pytest.raises(ApiError) as e:
        parse_json(b'{"prompt": [1, 2, "\\ud800"]}', max_depth=8)
    assert e.value.code == "invalid_unicode"
