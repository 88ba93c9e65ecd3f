"""The Triton row-wise argmax (kernels/argmax) against torch.argmax, in the interpreter here
and on the GPU in tests/gpu: first index on ties, NaN largest, chunk edges, strided rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.argmax import argmax_op  # noqa: E402
from kernels.argmax import reference as ref  # noqa: E402
from kernels.argmax import triton_argmax as tri  # noqa: E402
from kernels.split_counters import all_counters_zero  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("shape", [(1, 128256), (3, 49152), (2, 5000), (4, 7), (5, 4097), (1, 1), (0, 10)])
def test_argmax_matches_torch(shape):
    x = _rows(shape, seed=sum(shape))
    assert torch.equal(tri.argmax(x), ref.argmax(x))
    assert all_counters_zero()  # the merging program reset its row's counter


def test_ties_nan_and_minus_infinity_follow_torch():
    x = _rows((6, 9000), seed=1)
    x[0, 8000] = x[0, 5] = float("nan")  # first NaN wins, across chunks
    x[1, :] = float("-inf")  # every token banned: index 0, as torch
    x[2, 100] = x[2, 8500] = 50.0  # a tie across chunks: the first
    x[3, 4096] = x[3, 4097] = 60.0  # a tie inside the second chunk
    x[4, 8999] = float("nan")  # a NaN in the last, partial chunk
    x[5, 4095] = float("inf")
    assert torch.equal(tri.argmax(x), ref.argmax(x))


def test_strided_rows_as_the_sampler_passes_them():
    wide = _rows((3, 9100), seed=2)
    x = wide[:, :9000]  # the vocabulary slice of padded logits
    assert torch.equal(tri.argmax(x), ref.argmax(x))
    with pytest.raises(ValueError, match="contiguous columns"):
        tri.argmax(wide.t())


def test_argmax_op_picks_triton_on_cuda_only():
    assert argmax_op("cpu") is ref.argmax
    if torch.cuda.is_available():
        assert argmax_op("cuda") is tri.argmax
