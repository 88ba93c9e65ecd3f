"""Programmatic dependent launch (kernels/pdl) on a Hopper GPU: the overlap changes when
kernels start, never what they compute.

- A chain of dependent kernels (skinny GEMMs with their norms and activation, RMSNorm,
  SwiGLU), each reading the previous one's output, replayed in a CUDA graph with PDL on:
  bit-equal to the same chain with PDL off. A kernel that read its input before the
  previous grid had completed would see stale or half-written values.
- The engine's decode through its graphs with PDL on and off (``TIDEPOOL_PDL``): the same
  tokens and bit-equal logprobs.
"""

import pytest
import torch

from kernels import pdl
from kernels.activation.triton_activation import silu_and_mul
from kernels.gemv import threshold
from kernels.gemv.triton_gemv import norm_skinny_linear, skinny_linear
from kernels.norm.triton_norm import fused_add_rms_norm
from libs.engine import SamplingParams
from tests.gpu.test_decode_fusions_gpu import bf16_models, runs_under  # noqa: F401  (bf16_models: a fixture)
from tests.gpu.test_engine_gpu import prompts

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and not pdl.pdl_enabled("cuda"), reason="PDL needs compute capability 9.0+"),
]


def _chain(x, residual, weights, norm_weight):
    """Ten layers of dependent kernels: every launch reads what the one before wrote."""
    h, r = x, residual
    for w_up, w_down in weights:
        a, r = norm_skinny_linear(h, r, norm_weight, 1e-5, w_up, static_weight=True)  # add + norm + gate/up
        h = skinny_linear(a, w_down, silu_mul=True, static_weight=True)  # SwiGLU + down
        h, r = fused_add_rms_norm(h, r, norm_weight, 1e-5)  # a separate norm kernel
        h = skinny_linear(silu_and_mul(torch.cat([h, h], dim=1)), w_down[:, : h.shape[1]].contiguous())
    return h, r


@pytest.mark.parametrize("m", [1, 4])
def test_a_graph_of_dependent_kernels_with_pdl_equals_it_without(m, monkeypatch):
    torch.manual_seed(0)
    dev, hidden, inter = torch.device("cuda"), 1024, 4096
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=torch.bfloat16)
    weights = [(torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) / hidden**0.5,
                torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) / inter**0.5) for _ in range(10)]
    outs = {}
    for on in ("1", "0"):
        monkeypatch.setenv(pdl.ENV, on)
        _chain(x, residual, weights, norm_weight)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, r = _chain(x, residual, weights, norm_weight)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[on] = (h.clone(), r.clone())
        del graph
    assert torch.equal(outs["1"][0], outs["0"][0]) and torch.equal(outs["1"][1], outs["0"][1])
    assert outs["1"][0].abs().sum() > 0


def test_decode_with_pdl_equals_decode_without(bf16_models, monkeypatch):  # noqa: F811
    _, loaded = bf16_models
    monkeypatch.setenv(threshold.ENV, "64")  # every decode projection through the skinny GEMM
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    runs = runs_under(loaded, monkeypatch, pdl.ENV, ["0", "1"], ps, params)
    for off, on in zip(runs["0"], runs["1"]):
        assert on.token_ids == off.token_ids
        assert [lp.top_logprobs for lp in on.logprobs] == [lp.top_logprobs for lp in off.logprobs]
