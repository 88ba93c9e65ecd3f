"""The sampler's logit bias and grammar bitmasks, on fresh random logits, checked against
their definitions: bias added to the logits (``-100`` bans), disallowed tokens never
sampled, unconstrained rows untouched, and a row whose bias/bans leave no allowed token
falling back to the grammar's mask alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.engine import InvalidSamplingParamsError, SamplingParams
from libs.engine.sampler import Sampler, SamplingBatch

V = 64


def _batch(params, **kw) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params, generators=[None] * n, prompt_ids=[[]] * n, output_ids=[[]] * n, **kw)


def _mask(allowed_rows: list[list[int]]) -> torch.Tensor:
    bm = torch.zeros((len(allowed_rows), (V + 31) // 32), dtype=torch.int32)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            bm[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return bm


def test_bias_shifts_the_distribution_as_defined():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    bias = {3: 2.5, 10: -1.0}
    p = SamplingParams(temperature=1.0, logit_bias=bias)
    n = 20000
    tokens = Sampler(V, torch.device("cpu"))(logits.repeat(n, 1), _batch([p] * n)).token_ids
    z = logits[0].double().numpy().copy()
    for t, b in bias.items():
        z[t] += b
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    got = np.bincount(tokens, minlength=V) / n
    assert 0.5 * np.abs(got - want).sum() < 0.04


def test_minus_100_bans_and_plus_100_forces():
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 5
    greedy = int(logits[0].argmax())
    s = Sampler(V, torch.device("cpu"))
    out = s(logits, _batch([
        SamplingParams(temperature=0, logit_bias={greedy: -100}),
        SamplingParams(temperature=0, logit_bias={7: 100}),
        SamplingParams(temperature=1.0, logit_bias={greedy: -100}),
        SamplingParams(temperature=0),
    ])).token_ids
    assert out[0] != greedy and out[0] == int(logits[0].topk(2).indices[1])
    assert out[1] == 7
    assert out[3] == int(logits[3].argmax())
    many = s(logits[2:3].repeat(5000, 1), _batch([SamplingParams(temperature=2.0, logit_bias={int(logits[2].argmax()): -100})] * 5000)).token_ids
    assert int(logits[2].argmax()) not in many


def test_bitmask_restricts_only_its_rows():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    allowed = [5, 33, 63]
    s = Sampler(V, torch.device("cpu"))
    n = 3000
    params = [SamplingParams(temperature=1.5)] * n
    rows = list(range(0, n, 2))  # every other row constrained
    out = s(logits[0:1].repeat(n, 1), _batch(params, bitmask=_mask([allowed] * len(rows)), bitmask_rows=rows)).token_ids
    assert {out[r] for r in rows} <= set(allowed) and len({out[r] for r in rows}) == 3
    free = {out[r] for r in range(1, n, 2)}
    assert len(free) > 20  # unconstrained rows still sample the whole vocabulary
    greedy = s(logits, _batch([SamplingParams(temperature=0)] * 3, bitmask=_mask([allowed]), bitmask_rows=[1])).token_ids
    assert greedy[1] == allowed[int(logits[1, allowed].argmax())]
    assert greedy[0] == int(logits[0].argmax()) and greedy[2] == int(logits[2].argmax())


def test_grammar_wins_over_bias_and_bans():
    """The bias bans the only allowed token: the row samples by the grammar alone."""
    logits = torch.zeros(2, V)
    s = Sampler(V, torch.device("cpu"))
    p = SamplingParams(temperature=0, logit_bias={9: -100})
    out = s(logits, _batch([p, p], bitmask=_mask([[9], [9, 10]]), bitmask_rows=[0, 1], banned_ids=[[], []])).token_ids
    assert out == [9, 10]
    out = s(logits[:1], _batch([SamplingParams(temperature=0)], bitmask=_mask([[4]]), bitmask_rows=[0], banned_ids=[[4]])).token_ids
    assert out == [4]


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1}, {1: float("inf")}, {1: "x"}, [(1,)], 5])
def test_bad_bias_is_refused(bias):
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
