"""The Triton rejection sampler on CUDA at serving sizes (SmolLM2's 49152-token vocabulary,
up to 8 drafts, batch 64) against the torch reference on the same GPU, and captured in a
CUDA graph and replayed on new inputs (the verify step runs inside one). The chi-square test of
tests/unit/test_rejection_kernel.py runs the kernel itself when CUDA is present."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

triton = pytest.importorskip("triton")

from kernels.rejection import reference as ref  # noqa: E402
from kernels.rejection import triton_rejection as tri  # noqa: E402
from tests.unit.test_rejection_kernel import random_case  # noqa: E402


@pytest.mark.parametrize("K", [1, 4, 8])
@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_matches_reference_at_serving_sizes(K, with_q):
    for seed in range(3):
        args = random_case(64, K, 49152, seed=seed, with_q=with_q, sharp=4.0)
        assert torch.equal(tri.rejection_sample(*args), ref.rejection_sample(*args))


def test_kernel_in_a_cuda_graph():
    args = random_case(16, 4, 49152, seed=0, with_q=True, sharp=4.0)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    tri.rejection_sample(*static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.rejection_sample(*static)
    for seed in (1, 2):
        fresh = random_case(16, 4, 49152, seed=seed, with_q=True, sharp=4.0)
        for s, f in zip(static, fresh):
            if isinstance(s, torch.Tensor):
                s.copy_(f)
        graph.replay()
        assert torch.equal(out, ref.rejection_sample(*fresh))

