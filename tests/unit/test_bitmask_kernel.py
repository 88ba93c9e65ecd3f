"""The token bitmask kernel (kernels/bitmask): Triton against the torch reference on fresh
random inputs (in the interpreter on the CPU), and the reference against a per-token loop."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from kernels.bitmask import reference as ref  # noqa: E402
from kernels.bitmask import triton_bitmask as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random(n_rows: int, vocab: int, rows: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, vocab, generator=g)
    words = -(-vocab // 32) + 1  # one padding word, as engines allocate
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bitmask, torch.tensor(rows, dtype=torch.long)


def test_same_signature():
    assert inspect.signature(ref.apply_token_bitmask_) == inspect.signature(tri.apply_token_bitmask_)


def test_reference_matches_a_loop():
    logits, bitmask, rows = _random(5, 100, [3, 0], seed=1)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(100):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    got = ref.apply_token_bitmask_(logits.clone(), bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])  # unconstrained rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("vocab,rows", [(1000, [0, 2, 5]), (2053, [7]), (64, [])])
def test_triton_matches_reference(vocab, rows, dtype):
    for seed in range(2):
        logits, bitmask, idx = _random(8, vocab, rows, seed=seed)
        logits = logits.to(DEVICE, dtype)
        want = ref.apply_token_bitmask_(logits.clone(), bitmask.to(DEVICE), idx.to(DEVICE))
        got = tri.apply_token_bitmask_(logits.clone(), bitmask.to(DEVICE), idx.to(DEVICE))
        assert torch.equal(got, want)


@pytest.mark.parametrize("apply", [ref.apply_token_bitmask_, tri.apply_token_bitmask_])
def test_bad_shapes_are_refused(apply):
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="cannot cover"):
        apply(logits, torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="int32"):
        apply(logits, torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="bitmask rows"):
        apply(logits, torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0]))
