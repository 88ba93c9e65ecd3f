"""The gate/up GEMM with SwiGLU in its epilogue (kernels/swiglu_gemm) on CUDA at prefill
sizes, against the unfused path on the same GPU (cuBLAS, then kernels/activation's
``silu_and_mul``), captured in a CUDA graph, and through the model's MLP.

Tolerance: both paths round each product, silu and the result to the output dtype at the
same points; they differ only in the products' fp32 summation order, which can move a
product across a rounding edge: one ulp (bf16 2^-7 relative at most, fp16 2^-10), carried
through silu and the multiply. Most outputs are equal to the bit (all of them in the H200
probes, bench/RESULTS.md issue 10), and at least 95% must be.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

pytest.importorskip("triton")

from bench.swiglu_gemm_bench import CANDIDATES  # noqa: E402
from kernels.swiglu_gemm import reference as ref  # noqa: E402
from kernels.swiglu_gemm import threshold as thr  # noqa: E402
from kernels.swiglu_gemm import triton_swiglu_gemm as tri  # noqa: E402

RTOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    floor = 1e-3 * want.float().abs().max().item()
    diff = (got.float() - want.float()).abs()
    bad = diff > RTOL[want.dtype] * want.float().abs() + floor
    assert not bad.any(), f"{int(bad.sum())} outside tolerance; largest difference {diff.max().item():.3g}"
    equal = (got == want).float().mean().item()
    assert equal >= 0.95, f"only {equal:.1%} equal to the bit"


def _operands(m: int, k: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(torch.randint(0, 2**31, ()).item())  # fresh every run
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(2 * inter, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,inter", [(16384, 576, 1536), (1000, 896, 4864), (77, 2048, 8192), (300, 200, 40)])
def test_matches_the_unfused_path(dtype, m, k, inter):
    x, w = _operands(m, k, inter, dtype)
    _check(tri.swiglu_linear(x, w), ref.swiglu_linear(x, w))


@pytest.mark.parametrize("tiles", CANDIDATES)
def test_every_benchmarked_tiling(tiles):
    x, w = _operands(1500, 576, 1536, torch.bfloat16)
    _check(tri.swiglu_linear(x, w, tri.SwigluConfig(*tiles)), ref.swiglu_linear(x, w))


def test_graph_replay_on_new_inputs():
    x, w = _operands(4096, 576, 1536, torch.bfloat16)
    tri.swiglu_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.swiglu_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, ref.swiglu_linear(x, w))


def test_the_mlp_takes_it_and_agrees(monkeypatch):
    """With ``TIDEPOOL_SWIGLU_GEMM=1`` a prefill-sized MLP call goes through the kernel (its
    gate/up output comes back activated) and matches the unfused MLP; decode rows keep the
    skinny GEMM's path whatever the switch says."""
    from libs.model import linear
    from libs.model.config import ModelConfig
    from libs.model.llama import MLP

    cfg = ModelConfig("llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=64)
    mlp = MLP(cfg).to("cuda", torch.bfloat16)
    x = torch.randn(2048, 576, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(thr.ENV, "0")
    assert not linear.gate_up_linear(mlp.gate_up_proj, x)[1]
    want = mlp(x)
    monkeypatch.setenv(thr.ENV, "1")
    assert linear.gate_up_linear(mlp.gate_up_proj, x)[1]
    got = mlp(x)
    torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-3 * want.abs().max().item())
    one = x[:1]
    skinny = linear._skinny_operands(mlp.gate_up_proj, one) is not None
    assert linear.gate_up_linear(mlp.gate_up_proj, one)[1] is not skinny
