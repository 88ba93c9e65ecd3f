"""FP8 kernels (kernels/fp8) against their torch references, on the CPU.

What runs where:

- The Triton kernels run here in Triton's interpreter (``TRITON_INTERPRET=1``, set by
  tests/conftest.py), the very source the GPU compiles. With torch 2.13 / triton 3.9 the
  interpreter loads e4m3 (``float8e4nv``) correctly and ``tl.dot`` on it is exact (it
  widens to fp16, then multiplies in fp32), but its fp32 -> e4m3 cast truncates the
  mantissa without carrying into the exponent (31.2 -> 16). The quantization kernel never
  relies on that cast here: it rounds to the e4m3 grid in fp32 first (``_round_to_e4m3``;
  the GPU uses its hardware cast), so the cast only sees representable values. That is
  what makes the kernel bit-exact against torch's cast here, and it is tested below on
  every e4m3 value, every midpoint between two, subnormals and signed zeros (and the
  same cases in tests/gpu/test_fp8_gpu.py, through the hardware's cast).
- M in {1, 3, 16, 64, 65} runs the kernels in the interpreter, with K and N that are not
  multiples of 128. M = 4096 takes 20+ s per case in the interpreter, so on the CPU it is
  tested at the reference level only (the quantizer and the GEMM reference against exact
  fp32 within the e4m3 bound); tests/gpu/test_fp8_gpu.py runs the kernels at every M,
  including 4096, and at Llama-3-8B's shapes.

Tolerances, derived rather than tuned:

- quantizer: bit-exact (same IEEE divisions, same nearest-even rounding);
- kernel vs reference GEMM on the same quantized operands: only the fp32 summation order
  differs, so ``|dY| <= (2 K_pad + 8) 2**-24 * (|Xq| @ |Wq|^T)`` (two sums of K_pad terms,
  each within gamma_K of exact, plus the scaling products);
- quantized GEMM vs exact fp32: each operand element is within ``u |v| + 2**-10 s`` of
  its value (u = 2**-4, e4m3's unit roundoff; 2**-10 s half a subnormal step at scale s),
  so ``|dY| <= ex @ |W|^T + (|X| + ex) @ ew^T`` plus fp32 slack, elementwise.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import reference as ref
from kernels.fp8.capability import fp8_gemm_supported
from kernels.fp8.layout import (
    BLOCK,
    E4M3_MAX,
    E4M3_SUBNORMAL_HALF_STEP,
    E4M3_UNIT_ROUNDOFF,
    FP8_DTYPE,
    Fp8AlignmentError,
)
from kernels.fp8.plan import GemmPlan, plan_gemm, swap_ab_max_m
from kernels.fp8 import triton_gemm, triton_quant
from kernels.split_counters import all_counters_zero

INTERPRETED_M = [1, 3, 16, 64, 65]
K, N = 320, 200  # 2.5 and ~1.6 blocks: partial blocks on both axes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rand(*shape: int, seed: int) -> torch.Tensor:
    """Values spread over several orders of magnitude, so scales and subnormals vary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g))


def elementwise_error(v: torch.Tensor, scale_per_elem: torch.Tensor) -> torch.Tensor:
    """The most e4m3 quantization may move each element: ``u |v| + 2**-10 s``."""
    return E4M3_UNIT_ROUNDOFF * v.abs() + E4M3_SUBNORMAL_HALF_STEP * scale_per_elem


def activation_scales(s: torch.Tensor, m: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(BLOCK, dim=1)[:m, :k]


def weight_scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


# -- quantization ---------------------------------------------------------------------------


@pytest.mark.parametrize("m", INTERPRETED_M)
@pytest.mark.parametrize("swap_ab", [False, True])
def test_quant_kernel_is_bit_exact_and_pads_to_the_plans_tile(m, swap_ab):
    plan = plan_gemm(m, swap_ab=swap_ab)
    x = rand(m, K, seed=m)
    q, s = triton_quant.per_token_group_quant(x, row_multiple=plan.row_multiple)
    q_ref, s_ref = ref.per_token_group_quant(x, row_multiple=plan.row_multiple)
    assert q.shape[0] % plan.row_multiple == 0 and q.shape[0] >= m and q.shape[1] == 384
    assert same_bits(q, q_ref) and torch.equal(s, s_ref)
    assert not q.float()[m:].any() and not q.float()[:, K:].any()  # the padding is zeros
    assert (s > 0).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("m", [1, 17])
def test_quant_kernel_writes_column_major_scales_for_cublas(m):
    """cuBLAS's block-scaled GEMM reads the scales outer-dim-major: the kernel writes them
    so (a [K_pad/128, M_pad] tensor, transposed), the same values as row-major."""
    x = rand(m, K, seed=40 + m)
    q, s = triton_quant.per_token_group_quant(x, row_multiple=4, column_major_scales=True)
    q_ref, s_ref = ref.per_token_group_quant(x, row_multiple=4, column_major_scales=True)
    m_pad = q.shape[0]
    assert s.shape == (m_pad, 3) and s.stride() == (1, m_pad) and s_ref.stride() == (1, m_pad)
    assert same_bits(q, q_ref) and torch.equal(s, s_ref)
    assert torch.equal(s, ref.per_token_group_quant(x, row_multiple=4)[1])


def test_quant_multiplies_by_the_reciprocal_of_the_scale():
    """The reference's arithmetic, pinned: each value times the IEEE reciprocal of its group's
    scale (the kernel's, which must match it to the bit), not divided by the scale. On bf16
    activations the two differ on about one value in 2,000 (a quotient within an ulp of an
    e4m3 tie); this input has such values."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4 * BLOCK, generator=g) * 3).to(torch.bfloat16)
    q, s = ref.per_token_group_quant(x)
    groups = x.float().view(64, 4, BLOCK)
    by_reciprocal = (groups * (torch.ones_like(s) / s)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    by_division = (groups / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    assert same_bits(q, by_reciprocal.view(64, 4 * BLOCK))
    assert not same_bits(q, by_division.view(64, 4 * BLOCK))


def rounding_cases(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, vals)``: every finite e4m3 value, every tie between two, tiny and saturating
    values and signed zeros, laid out as groups whose first column is 448 (so each
    group's scale is exactly 1 and the quantized group is its values rounded); ``vals``
    in order from ``x[:, 1:]``. Shared with tests/gpu (the hardware's cast)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = codes[~codes.isnan()].unique()  # every finite e4m3 value, both zeros
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: nearest-even decides
    vals = torch.cat([grid, mids, -mids, torch.tensor([-0.0, 2.0**-12, -(2.0**-12), 447.9, 449.0])])
    vals = vals.clamp(-E4M3_MAX, E4M3_MAX)
    n = vals.numel()
    rows = -(-n // (BLOCK - 1))
    x = torch.zeros(rows * (BLOCK - 1))
    x[:n] = vals
    x = x.view(rows, BLOCK - 1)
    x = torch.cat([torch.full((rows, 1), E4M3_MAX), x], dim=1)  # amax 448: scale exactly 1
    return x.to(device), vals.to(device)


def check_rounding(x: torch.Tensor, vals: torch.Tensor) -> None:
    q, s = triton_quant.per_token_group_quant(x)
    q_ref, s_ref = ref.per_token_group_quant(x)
    assert torch.equal(s, torch.ones_like(s))
    assert same_bits(q, q_ref)
    assert same_bits(q[:, 1:].reshape(-1)[: vals.numel()], vals.to(FP8_DTYPE))


def test_quant_kernel_rounds_ties_subnormals_and_signs_like_torch():
    check_rounding(*rounding_cases())


def test_quant_kernel_reads_strided_and_bf16_input():
    x = rand(40, 2 * K, seed=3)[:, ::2]  # a column stride of 2
    q, s = triton_quant.per_token_group_quant(x, row_multiple=16)
    q_ref, s_ref = ref.per_token_group_quant(x, row_multiple=16)
    assert same_bits(q, q_ref) and torch.equal(s, s_ref)
    xb = rand(5, K, seed=4).to(torch.bfloat16)
    q, s = triton_quant.per_token_group_quant(xb)
    q_ref, s_ref = ref.per_token_group_quant(xb)
    assert same_bits(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("m", INTERPRETED_M + [4096])
def test_activation_round_trip_within_e4m3_error(m):
    x = rand(m, K, seed=10 + m)
    q, s = ref.per_token_group_quant(x)
    back = ref.dequantize_activation(q, s)[:m, :K]
    assert ((back - x).abs() <= elementwise_error(x, activation_scales(s, m, K))).all()
    assert (back != 0).float().mean() > 0.9  # most values survive: the bound is not vacuous


def test_weight_round_trip_within_e4m3_error():
    w = rand(N, K, seed=20)
    q, s = ref.quantize_weight(w)
    assert q.shape == (256, 384) and s.shape == (2, 3)
    back = ref.dequantize_weight(q, s)
    assert not back[N:].any() and not back[:, K:].any()
    assert ((back[:N, :K] - w).abs() <= elementwise_error(w, weight_scales(s, N, K))).all()
    # A partial block's scale is the amax of its real values over 448 (vLLM's).
    assert s[1, 2] == w[128:, 256:].abs().max() / E4M3_MAX


def test_scales_are_never_zero_or_inf():
    big = torch.finfo(torch.float32).max
    x = torch.zeros(6, 3 * BLOCK)
    x[1, :BLOCK] = 1e38  # huge
    x[2, :BLOCK] = big
    x[3, 0] = float("inf")
    x[4, :BLOCK] = 1e-30  # below the amax floor
    x[5, :BLOCK] = -big
    for quant in (ref.per_token_group_quant, triton_quant.per_token_group_quant):
        q, s = quant(x)
        assert (s > 0).all() and torch.isfinite(s).all(), s
        assert not q.float().isnan().any()
        assert same_bits(q[0], torch.zeros(3 * BLOCK, dtype=FP8_DTYPE))  # all-zero group: zeros
        assert q.float()[1, :BLOCK].eq(E4M3_MAX).all() and q.float()[5, :BLOCK].eq(-E4M3_MAX).all()
    wq, ws = ref.quantize_weight(x)
    assert (ws > 0).all() and torch.isfinite(ws).all()


# -- GEMM -----------------------------------------------------------------------------------


def operands(m: int, swap_ab: bool, seed: int):
    plan = plan_gemm(m, swap_ab=swap_ab)
    x, w = rand(m, K, seed=seed), rand(N, K, seed=seed + 1) * 0.05
    x_q, x_s = ref.per_token_group_quant(x, row_multiple=plan.row_multiple)
    w_q, w_s = ref.quantize_weight(w)
    return plan, x, w, x_q, x_s, w_q, w_s


@pytest.mark.parametrize("m", INTERPRETED_M)
@pytest.mark.parametrize("swap_ab", [False, True])
def test_gemm_kernel_matches_reference(m, swap_ab):
    plan, _, _, x_q, x_s, w_q, w_s = operands(m, swap_ab, seed=100 + m)
    y = triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=plan)
    y_ref = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=plan)
    assert y.shape == (m, N) and y.dtype == torch.float32
    abs_products = ref.dequantize_activation(x_q, x_s)[:m].abs() @ ref.dequantize_weight(w_q, w_s)[:N].abs().t()
    tol = (2 * x_q.shape[1] + 8) * 2.0**-24 * abs_products
    assert ((y - y_ref).abs() <= tol).all(), (y - y_ref).abs().max()
    assert (y != 0).all()  # every output written, none left from torch.empty


@pytest.mark.parametrize("m", INTERPRETED_M + [4096])
def test_quantized_gemm_within_e4m3_bound_of_exact(m):
    plan, x, w, x_q, x_s, w_q, w_s = operands(m, swap_ab=m <= swap_ab_max_m(), seed=200 + m)
    y = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=plan)
    exact = x.double() @ w.double().t()
    ex = elementwise_error(x, activation_scales(x_s, m, K)).double()
    ew = elementwise_error(w, weight_scales(w_s, N, K)).double()
    bound = ex @ w.double().abs().t() + (x.double().abs() + ex) @ ew.t()
    slack = 2.0**-20 * (x.double().abs() @ w.double().abs().t())  # fp32 accumulation
    err = (y.double() - exact).abs()
    assert (err <= bound + slack).all()
    assert err.max() > 0  # it is quantized: exactness would mean the test compares nothing


def test_swap_ab_and_normal_variants_agree():
    plan_s, _, _, x_q, x_s, w_q, w_s = operands(3, swap_ab=True, seed=7)
    y_swap = triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=3, n=N, plan=plan_s)
    plan_n = plan_gemm(3, swap_ab=False)
    x_q64 = torch.zeros(plan_n.row_multiple, x_q.shape[1], dtype=FP8_DTYPE)
    x_q64[:16] = x_q
    x_s64 = torch.ones(plan_n.row_multiple, x_s.shape[1])
    x_s64[:16] = x_s
    y_norm = triton_gemm.block_scaled_mm(x_q64, x_s64, w_q, w_s, m=3, n=N, plan=plan_n)
    assert torch.allclose(y_swap, y_norm, rtol=1e-5, atol=1e-6)


def summation_tolerance(x_q, x_s, w_q, w_s, m: int) -> torch.Tensor:
    """Two fp32 sums of the same products in different orders: ``(2 K_pad + 8) 2**-24``
    of the sum of their magnitudes, elementwise."""
    abs_products = ref.dequantize_activation(x_q, x_s)[:m].abs() @ ref.dequantize_weight(w_q, w_s)[:N].abs().t()
    return (2 * x_q.shape[1] + 8) * 2.0**-24 * abs_products


@pytest.mark.parametrize("m", INTERPRETED_M)
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fused_quantization_is_bit_identical_to_the_two_launches(m, swap_ab):
    """The GEMM that quantizes its own activations (in registers, with the quantization
    kernel's own arithmetic) gives exactly the bits of the quantization kernel followed
    by the same GEMM: same e4m3 values, same scales, same sums in the same order."""
    x, w = rand(m, K, seed=300 + m), rand(N, K, seed=301) * 0.05
    w_q, w_s = ref.quantize_weight(w)
    tiles = dict(token_tile=16 if swap_ab else 32, weight_tile=64, num_warps=4, num_stages=2)
    fused = triton_gemm.fp8_linear(x, w_q, w_s, n=N, plan=GemmPlan(swap_ab, **tiles, fuse_quant=True))
    two = triton_gemm.fp8_linear(x, w_q, w_s, n=N, plan=GemmPlan(swap_ab, **tiles))
    assert fused.shape == (m, N) and fused.dtype == torch.float32
    assert torch.equal(fused, two)
    expected = ref.fp8_linear(x, w_q, w_s, n=N, plan=GemmPlan(swap_ab, **tiles, fuse_quant=True))
    x_q, x_s = ref.per_token_group_quant(x)
    assert ((fused - expected).abs() <= summation_tolerance(x_q, x_s, w_q, w_s, m)).all()


def test_a_fused_plan_is_one_launch(monkeypatch):
    """What a decode step saves: the fused plan never calls the quantization kernel (and
    allocates no padded activations), the other plan calls it once."""
    calls = []
    real = triton_gemm.per_token_group_quant
    monkeypatch.setattr(triton_gemm, "per_token_group_quant", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w_q, w_s = rand(2, K, seed=700), *ref.quantize_weight(rand(N, K, seed=701))
    fused = triton_gemm.fp8_linear(x, w_q, w_s, n=N, plan=GemmPlan(True, 16, 64, 4, 2, fuse_quant=True))
    assert calls == []
    assert torch.equal(fused, triton_gemm.fp8_linear(x, w_q, w_s, n=N, plan=GemmPlan(True, 16, 64, 4, 2))) and calls == [1]


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_split_k_sums_partials_deterministically_and_resets_its_counters(split_k, swap_ab):
    """K_pad = 384 is 3 blocks: split 2 gives programs of 2 and 1 blocks, split 4 one
    program with none (it must add a zero partial, not garbage)."""
    m = 17
    plan, _, _, x_q, x_s, w_q, w_s = operands(m, swap_ab, seed=400 + split_k)
    split = GemmPlan(plan.swap_ab, plan.token_tile, 64, 4, 2, split_k=split_k)
    y = triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=split)
    y_ref = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=split)
    assert ((y - y_ref).abs() <= summation_tolerance(x_q, x_s, w_q, w_s, m)).all()
    assert (y != 0).all()
    assert torch.equal(y, triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=N, plan=split))  # fixed order
    assert all_counters_zero()  # ready for the next launch


@pytest.mark.parametrize("swap_ab", [False, True])
def test_tma_plans_read_the_same_operands(swap_ab):
    plan, _, _, x_q, x_s, w_q, w_s = operands(16, swap_ab, seed=500)
    tma = GemmPlan(plan.swap_ab, plan.token_tile, 64, 4, 2, tma=True)
    y = triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=16, n=N, plan=tma)
    y_ref = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=16, n=N, plan=tma)
    assert ((y - y_ref).abs() <= summation_tolerance(x_q, x_s, w_q, w_s, 16)).all()


def test_wide_weight_tiles_read_each_rows_block_scale():
    """A 256-row weight tile spans two 128-row blocks with different scales."""
    m, n = 5, 256
    x, w = rand(m, K, seed=600), rand(n, K, seed=601) * 0.05
    w[128:] *= 40  # the second block's scale is 40x the first's
    w_q, w_s = ref.quantize_weight(w)
    plan = GemmPlan(False, 16, 256, 4, 2)
    y = triton_gemm.fp8_linear(x, w_q, w_s, n=n, plan=plan)
    x_q, x_s = ref.per_token_group_quant(x, row_multiple=16)
    y_ref = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=n, plan=GemmPlan(False, 16, 128, 4, 2))
    abs_products = ref.dequantize_activation(x_q, x_s)[:m].abs() @ ref.dequantize_weight(w_q, w_s).abs().t()
    assert ((y - y_ref).abs() <= (2 * x_q.shape[1] + 8) * 2.0**-24 * abs_products).all()


def test_gemm_writes_bf16_output_on_request():
    plan, _, _, x_q, x_s, w_q, w_s = operands(16, swap_ab=True, seed=8)
    y = ref.block_scaled_mm(x_q, x_s, w_q, w_s, m=16, n=N, out_dtype=torch.bfloat16, plan=plan)
    assert y.dtype == torch.bfloat16


# -- the contract: plans, alignment, capability -------------------------------------------


def test_plan_follows_the_stored_threshold():
    t = swap_ab_max_m()
    assert plan_gemm(max(t, 1)).swap_ab == (t >= 1)
    assert not plan_gemm(t + 1).swap_ab
    assert plan_gemm(1, swap_ab=False).token_tile == 64 and plan_gemm(1, swap_ab=True).token_tile == 16
    assert plan_gemm(65, swap_ab=False).token_tile == 128
    for m in (1, 3, 16, 17, 64, 65, 4096):
        for swap in (False, True):
            p = plan_gemm(m, swap_ab=swap)
            assert BLOCK % p.weight_tile == 0 and p.token_tile >= 16
            assert p.split_k == 1 and not p.tma  # no device, no SM count: no split-K
            assert not p.fuse_quant  # measured 2-7x slower than its own quantizer kernel (bench/RESULTS.md)
    with pytest.raises(ValueError):
        plan_gemm(0)


@pytest.mark.parametrize("gemm", [ref.block_scaled_mm, triton_gemm.block_scaled_mm])
def test_misaligned_operands_fail_with_a_clear_error(gemm):
    plan, _, _, x_q, x_s, w_q, w_s = operands(3, swap_ab=True, seed=9)
    normal = plan_gemm(3, swap_ab=False)
    with pytest.raises(Fp8AlignmentError, match="token tile"):  # padded for swap-AB, run normal
        gemm(x_q, x_s, w_q, w_s, m=3, n=N, plan=normal)
    with pytest.raises(Fp8AlignmentError, match="K_pad"):
        gemm(x_q[:, :256], x_s[:, :2], w_q, w_s, m=3, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="multiples of 128"):
        gemm(x_q, x_s, w_q[:200], w_s, m=3, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="float8"):
        gemm(x_q.float(), x_s, w_q, w_s, m=3, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="16-byte"):
        shifted = torch.zeros(16 * 384 + 8, dtype=FP8_DTYPE)[8:].view(16, 384)
        gemm(shifted, x_s, w_q, w_s, m=3, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="m \\(17\\)"):
        gemm(x_q, x_s, w_q, w_s, m=17, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="activation scale"):
        gemm(x_q, x_s.t().contiguous().t(), w_q, w_s, m=3, n=N, plan=plan)
    with pytest.raises(Fp8AlignmentError, match="weight tile \\(256\\)"):  # 256 does not divide N_pad = 384
        w3_q, w3_s = ref.quantize_weight(rand(300, K, seed=9))
        gemm(x_q, x_s, w3_q, w3_s, m=3, n=300, plan=GemmPlan(True, 16, 256, 4, 2))


@pytest.mark.parametrize("linear", [ref.fp8_linear, triton_gemm.fp8_linear])
def test_fused_path_checks_its_operands(linear):
    w_q, w_s = ref.quantize_weight(rand(N, K, seed=11))
    fused = GemmPlan(True, 16, 64, 4, 2, fuse_quant=True)
    with pytest.raises(Fp8AlignmentError, match="K_pad"):
        linear(rand(3, 100, seed=12), w_q, w_s, n=N, plan=fused)
    with pytest.raises(Fp8AlignmentError, match="unquantized"):
        linear(rand(3, K, seed=12).to(FP8_DTYPE), w_q, w_s, n=N, plan=fused)
    with pytest.raises(Fp8AlignmentError, match="n \\(300\\)"):
        linear(rand(3, K, seed=12), w_q, w_s, n=300, plan=fused)


def test_capability_is_false_here_and_never_raises(monkeypatch):
    for device in (None, "cpu", "cuda", "cuda:9", "not-a-device", torch.device("cpu")):
        assert fp8_gemm_supported(device) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for cap, expected in (((9, 0), True), ((8, 9), True), ((8, 6), False), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert fp8_gemm_supported("cuda:0") is expected

    def broken(d=None):
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert fp8_gemm_supported("cuda") is False


def test_cublas_block_path_is_a_question_and_data():
    """kernels/fp8/cublas_gemm.py: usable answers False (never raises) off CUDA, for a bad
    device and for shapes cuBLAS refuses; its M threshold is data; Fp8Linear takes it from
    that M up where usable, the Triton path below."""
    from kernels.fp8 import cublas_gemm
    from kernels.fp8.plan import CUBLAS_THRESHOLD_FILE, cublas_min_m

    assert cublas_gemm.cublas_block_fp8_usable("cpu", 4096, 4096) is False
    assert cublas_gemm.cublas_block_fp8_usable("not a device", 4096, 4096) is False
    assert cublas_gemm.shape_ok(4096, 14336) and not cublas_gemm.shape_ok(640, 640)  # 5 K blocks
    assert not cublas_gemm.shape_ok(4000, 4096)
    import json

    assert cublas_min_m() == json.loads(CUBLAS_THRESHOLD_FILE.read_text())["cublas_min_m"] >= 1


def test_fp8_linear_dispatches_large_m_to_cublas_where_usable(monkeypatch):
    import libs.model.fp8 as fp8
    from kernels.fp8 import cublas_gemm, triton_gemm
    from kernels.fp8.plan import cublas_min_m

    layer = fp8.Fp8Linear(fp8.Fp8Weight.quantize(torch.randn(256, 512) * 0.02))
    calls: list[str] = []
    monkeypatch.setattr(cublas_gemm, "cublas_block_fp8_usable", lambda device, n, k: True)
    monkeypatch.setattr(cublas_gemm, "fp8_linear", lambda x, *a, **kw: calls.append("cublas") or x.new_zeros(x.shape[0], 256))
    monkeypatch.setattr(triton_gemm, "fp8_linear", lambda x, *a, **kw: calls.append("triton") or x.new_zeros(x.shape[0], 256))
    m = cublas_min_m()
    layer._fp8_gemm(torch.randn(m, 512), 256)
    layer._fp8_gemm(torch.randn(m - 1, 512), 256)
    assert calls == ["cublas", "triton"]
    monkeypatch.setattr(cublas_gemm, "cublas_block_fp8_usable", lambda device, n, k: False)
    layer._fp8_gemm(torch.randn(m, 512), 256)
    assert calls[-1] == "triton"
