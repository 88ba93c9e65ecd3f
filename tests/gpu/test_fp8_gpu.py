"""FP8 kernels and FP8 weights on a GPU with FP8 tensor cores (SM 8.9+): every M of the
issue (1, 3, 16, 64, 65, 4096) at full size, both GEMM variants, Llama-3-8B's shapes, the
SmolLM2 shapes that do not fill their blocks, bf16 in and out, every kernel feature a plan
can turn on (split-K, fused quantization, TMA, 256-row tiles), every plan the tuner stored
for this GPU, CUDA graphs, and the engine.

Tolerances. The quantizer is bit-exact (IEEE divisions, explicit nearest-even rounding).
The GEMM against the reference on the same quantized operands: the tensor cores sum each
block of 128 FP8 products with a reduced-precision accumulator (DeepSeek-V3 measured about
14 bits on Hopper) before the kernel adds the scaled block sum in fp32, so each block's
sum may lose up to 127 * 2**-14 < 2**-7 of the sum of its products' magnitudes: the
elementwise bound is ``2**-7 * (|Xq| @ |Wq|^T)`` (plus bf16's 2**-8 of |Y| when the output
is bf16). That is loose by design (a worst case); a wrong scale or block moves outputs by
tens of percent of that sum, and the norm-wise error is also held to 2**-9.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import GemmPlan, fp8_gemm_supported, plan_gemm
from kernels.fp8 import reference as ref

pytestmark = pytest.mark.skipif(not fp8_gemm_supported("cuda"), reason="needs CUDA with FP8 tensor cores (SM 8.9+)")

MS = [1, 3, 16, 64, 65, 4096]
LLAMA3_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]  # N x K
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # not multiples of 128
LLAMA32_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # the decode benchmark's


def rand(*shape: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", [576, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_kernel_is_bit_exact_on_the_gpu(m, k, dtype):
    from kernels.fp8 import triton_quant

    x = rand(m, k, seed=m + k, dtype=dtype) * 3
    for swap in (False, True):
        rows = plan_gemm(m, swap_ab=swap).row_multiple
        q, s = triton_quant.per_token_group_quant(x, row_multiple=rows)
        q_ref, s_ref = ref.per_token_group_quant(x, row_multiple=rows)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_quant_kernel_rounds_ties_subnormals_and_signs_like_torch_on_the_gpu():
    """The hardware's fp32 -> e4m3 cast (the GPU's rounding in ``quantize_groups``) against
    torch's on every e4m3 value, every tie, subnormals, saturation and signed zeros."""
    from tests.unit.test_fp8_kernels import check_rounding, rounding_cases

    check_rounding(*rounding_cases("cuda"))


def check_gemm(m: int, n: int, k: int, swap_ab: bool | None, out_dtype: torch.dtype, seed: int, plan=None) -> None:
    """``fp8_linear`` (the plan this GPU picks for the shape, tuned or heuristic, unless one
    is given) against the reference on the same quantized operands."""
    from kernels.fp8 import triton_gemm

    plan = plan or plan_gemm(m, swap_ab=swap_ab, n=n, k=k, device="cuda")
    x, w = rand(m, k, seed=seed), rand(n, k, seed=seed + 1) * 0.02
    w_q, w_s = ref.quantize_weight(w)
    y = triton_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=out_dtype, plan=plan)
    x_q, x_s = ref.per_token_group_quant(x, row_multiple=plan.row_multiple)
    y_ref = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=n, plan=plan)
    abs_products = ref.dequantize_activation(x_q, x_s)[:m].abs() @ ref.dequantize_weight(w_q, w_s)[:n].abs().t()
    tol = 2.0**-7 * abs_products + (2.0**-8 * y_ref.abs() if out_dtype == torch.bfloat16 else 0)
    err = (y.float() - y_ref).abs()
    assert y.shape == (m, n) and y.dtype == out_dtype
    assert (err <= tol).all(), (plan.label, err.max())
    assert err.norm() <= 2.0**-9 * y_ref.norm() + (2.0**-8 * y_ref.norm() if out_dtype == torch.bfloat16 else 0), plan.label


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("nk", SMOLLM2[:2] + LLAMA3_8B[:1])
def test_gemm_matches_reference(m, swap_ab, nk):
    check_gemm(m, *nk, swap_ab=swap_ab, out_dtype=torch.float32, seed=m)


@pytest.mark.parametrize("nk", LLAMA3_8B + SMOLLM2 + LLAMA32_1B)
@pytest.mark.parametrize("m", [1, 16, 65, 4096])
def test_gemm_bf16_at_model_shapes(m, nk):
    check_gemm(m, *nk, swap_ab=None, out_dtype=torch.bfloat16, seed=7 * m)


def feature_plans() -> list[GemmPlan]:
    """Each kernel feature the tuner may pick, on its own and combined."""
    plans = []
    for swap, tt in ((True, 16), (True, 64), (False, 64), (False, 128)):
        plans += [
            GemmPlan(swap, tt, 64, 4, 4, split_k=2),
            GemmPlan(swap, tt, 32, 4, 5, split_k=8),
            GemmPlan(swap, tt, 128, 4, 4, fuse_quant=True),
            GemmPlan(swap, tt, 64, 4, 5, split_k=4, fuse_quant=True),
            GemmPlan(swap, tt, 128, 8 if tt == 128 else 4, 3, tma=True),
            GemmPlan(swap, tt, 256, 8, 3, group=16),
        ]
    return plans


@pytest.mark.parametrize("plan", feature_plans(), ids=lambda p: p.label.replace(" ", "-"))
def test_every_kernel_feature_matches_reference(plan):
    check_gemm(3, 4096, 14336, None, torch.bfloat16, seed=11, plan=plan)
    check_gemm(65, 576, 576, None, torch.float32, seed=13, plan=GemmPlan.from_dict({**plan.to_dict(), "weight_tile": min(plan.weight_tile, 128)}))


def tuned_entries() -> list[tuple[str, int, GemmPlan]]:
    """Each distinct plan bench/fp8_tune.py stored for this GPU, with a shape and M it won at."""
    from kernels.fp8 import plan as plan_mod

    if not fp8_gemm_supported("cuda"):
        return []
    name = torch.cuda.get_device_name()
    found: dict[GemmPlan, tuple[str, int, GemmPlan]] = {}
    for shape, variants in plan_mod.tuned_configs().get(name, {}).items():
        for entries in variants.values():
            for e in entries:
                found.setdefault(e.plan, (shape, e.max_m, e.plan))
    return list(found.values())


@pytest.mark.parametrize("shape, max_m, plan", tuned_entries())
def test_every_tuned_plan_of_this_gpu_matches_reference(shape, max_m, plan):
    """What bench/fp8_tune.py stored for this GPU (each distinct plan once), at an M it was
    tuned for and an odd M below it (a bucket serves every M down to the previous one)."""
    n, k = map(int, shape.split("x"))
    for m in sorted({max_m, max(1, max_m // 2 + 1)}):
        check_gemm(m, n, k, None, torch.bfloat16, seed=m + n, plan=plan)


def test_split_k_and_fused_plans_replay_in_a_cuda_graph_bit_for_bit():
    """A CUDA graph keeps the split-K workspace and counters' addresses; replays with new
    inputs give the eager call's exact bits (the partials are summed in a fixed order)."""
    from kernels.fp8 import triton_gemm

    w_q, w_s = ref.quantize_weight(rand(2048, 8192, seed=21, dtype=torch.float32) * 0.02)
    for plan in (GemmPlan(True, 16, 64, 4, 4, split_k=4, fuse_quant=True), GemmPlan(False, 64, 64, 4, 4, split_k=3)):
        static_x = rand(5, 8192, seed=22)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            triton_gemm.fp8_linear(static_x, w_q, w_s, n=2048, plan=plan)  # warm: compiles, makes this stream's counters
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_y = triton_gemm.fp8_linear(static_x, w_q, w_s, n=2048, plan=plan)
        for seed in (23, 24, 25):
            static_x.copy_(rand(5, 8192, seed=seed))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, triton_gemm.fp8_linear(static_x, w_q, w_s, n=2048, plan=plan)), plan.label


def test_fp8_linear_runs_the_kernels_and_captures_in_a_cuda_graph():
    import libs.model.fp8 as fp8

    w = rand(960, 576, seed=3, dtype=torch.float32) * 0.05
    layer = fp8.Fp8Linear(fp8.Fp8Weight.quantize(w)).cuda()
    x = rand(8, 576, seed=4)
    y = layer(x)
    cpu = fp8.Fp8Linear(fp8.Fp8Weight.quantize(w.cpu()))(x.float().cpu())  # the reference path
    assert y.dtype == torch.bfloat16 and layer._dense is None  # kernels, not a dequantized copy
    assert torch.allclose(y.float().cpu(), cpu, rtol=2e-2, atol=2e-2)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(rand(8, 576, seed=5))
    graph.replay()
    assert torch.equal(static_y, layer(static_x))



@pytest.mark.parametrize("m", [2048, 2050, 4096])
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336)])
def test_cublas_block_gemm_matches_reference_and_serves_large_m(m, nk):
    """cuBLASLt's block-scaled GEMM (kernels/fp8/cublas_gemm.py) on Hopper: usable at the
    Llama shapes, equal to the reference within the GEMM tolerance, what Fp8Linear runs
    from cublas_min_m tokens up, and capturable in a CUDA graph."""
    import libs.model.fp8 as fp8
    from kernels.fp8 import cublas_gemm
    from kernels.fp8.plan import cublas_min_m

    n, k = nk
    if torch.cuda.get_device_capability() != (9, 0):
        assert not cublas_gemm.cublas_block_fp8_usable("cuda", n, k)
        pytest.skip("cuBLASLt's block-scaled FP8 recipes are SM90-only in torch")
    assert cublas_gemm.cublas_block_fp8_usable("cuda", n, k), f"torch {torch.__version__}: block-scaled scaled_mm unavailable"
    w_q, w_s = ref.quantize_weight(rand(n, k, seed=n + k, dtype=torch.float32) * 0.02)
    x = rand(m, k, seed=m)
    want = ref.fp8_linear(x, w_q, w_s, n=n, out_dtype=torch.float32)
    got = cublas_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=torch.bfloat16)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() <= 2.0**-7 * want.norm()
    layer = fp8.Fp8Linear(fp8.Fp8Weight(w_q, w_s, (n, k))).cuda()
    if m >= cublas_min_m():
        assert torch.equal(layer(x), got)  # the layer took the cuBLAS path
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = cublas_gemm.fp8_linear(static_x, w_q, w_s, n=n, out_dtype=torch.bfloat16)
    static_x.copy_(rand(m, k, seed=m + 1))
    graph.replay()
    assert torch.equal(static_y, cublas_gemm.fp8_linear(static_x, w_q, w_s, n=n, out_dtype=torch.bfloat16))


def fp8_smollm2_shape():
    """Random SmolLM2-shaped weights (the GGUF does not travel to GPU machines), FP8 at load."""
    from bench.common import hf_llama, ours_from_hf
    from libs.model.fp8 import Fp8Linear, quantize_projections

    loaded = ours_from_hf(hf_llama(torch.device("cuda"), torch.float32), torch.device("cuda"), torch.bfloat16)
    quantize_projections(loaded.model, torch.device("cuda"))
    assert sum(isinstance(m, Fp8Linear) for m in loaded.model.modules()) == 120
    return loaded


def fp8_generate(loaded, **cfg) -> list[list[int]]:
    from libs.engine import LLM, EngineConfig, SamplingParams

    prompts = [list(range(100 + i, 140 + 3 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(EngineConfig(device="cuda", dtype="bfloat16", num_blocks=512, max_num_seqs=8, **cfg), loaded=loaded)
    try:
        return [r.token_ids for r in llm.generate(prompts, params)]
    finally:
        llm.close()


def test_engine_with_fp8_weights_decodes_with_cuda_graphs():
    """Decode through CUDA graphs gives the eager engine's tokens."""
    loaded = fp8_smollm2_shape()
    assert fp8_generate(loaded) == fp8_generate(loaded, cuda_graphs=False)


def test_fp8_kernels_with_pdl_give_the_same_tokens(monkeypatch):
    """kernels/fp8's quantizer and GEMM in programmatic dependent launch (by default with
    the swap-AB plan, ``TIDEPOOL_PDL_FP8=1`` with every plan) through the engine's CUDA graphs, the
    skinny GEMM off so that every FP8 projection runs them: the same tokens as without
    (``0``), and the same bits for a chain of dependent FP8 layers replayed in a graph."""
    from kernels.fp8 import triton_gemm
    from kernels.fp8.triton_quant import FP8_PDL_ENV
    from kernels.gemv.threshold import FP8_ENV

    monkeypatch.setenv(FP8_ENV, "0")
    loaded = fp8_smollm2_shape()
    runs, chains = {}, {}
    x0 = rand(4, 576, seed=3)
    weights = [ref.quantize_weight(rand(576, 576, seed=10 + i) * 0.05) for i in range(6)]
    unfused = GemmPlan(True, token_tile=16, weight_tile=64, num_warps=4, num_stages=4, split_k=2)
    for value in ("0", "", "1"):
        monkeypatch.setenv(FP8_PDL_ENV, value)
        runs[value] = fp8_generate(loaded)

        def chain() -> torch.Tensor:
            x = x0
            for w_q, w_s in weights:  # each layer reads what the previous one wrote
                x = triton_gemm.fp8_linear(x, w_q, w_s, n=576, plan=unfused)  # the quantizer, then the split-K GEMM
            return x

        chain()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        chains[value] = out.clone()
    assert runs["1"] == runs[""] == runs["0"]
    assert torch.equal(chains["1"], chains["0"]) and torch.equal(chains[""], chains["0"])
