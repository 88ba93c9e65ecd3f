"""FP8 MoE experts: the block-scaled grouped GEMMs (kernels/moe/gemm, ``*_fp8``) Triton
against the torch reference, the reference against exact products within e4m3's error,
the alignment contract, and the expert weights' format (libs/model/fp8.py ``Fp8Experts``).

Without CUDA the Triton kernel runs in the interpreter (tests/conftest.py), fp32 out.
Shapes are chosen so K (200) and the intermediate size (72) are not multiples of 128
(padded per expert, and per half of the fused gate/up weight), the routing leaves some
experts with no rows (``skewed``) or sends pairs elsewhere (EP's out-of-range ids), and
row counts are not multiples of the M tile.

Tolerances:
- Triton vs reference: the same e4m3 operands and scales, products exact in fp32, so only
  fp32 summation order differs: ``(2 K_pad + 8) 2**-24`` of the sum of the products'
  magnitudes (the dense FP8 GEMM's bound, tests/unit/test_fp8_kernels.py); with SwiGLU
  fused, the same bound through silu(g) * u (both factors perturbed: the bound times
  ``|u| + |silu(g)|``, silu being 1.1-Lipschitz).
- Reference vs the unquantized product: each operand moves by at most ``u |v| + 2**-10 s``
  (e4m3's unit roundoff ``u = 2**-4``, half its subnormal step times the block's scale),
  propagated through the dot product, plus fp32 accumulation slack.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp8 import BLOCK, FP8_DTYPE, Fp8AlignmentError  # noqa: E402
from kernels.fp8 import reference as fp8_ref  # noqa: E402
from kernels.fp8.layout import padded  # noqa: E402
from kernels.moe.gemm import reference as gemm_ref  # noqa: E402
from kernels.moe.gemm import triton_gemm as gemm_tri  # noqa: E402
from kernels.moe.scatter import reference as scatter_ref  # noqa: E402
from libs.model.fp8 import Fp8Experts, Fp8Weight  # noqa: E402
from tests.moe_inputs import make_ids  # noqa: E402
from tests.unit.test_fp8_kernels import activation_scales, elementwise_error, rand, weight_scales  # noqa: E402

E, TOP_K, H, INTER = 4, 2, 200, 72
BLOCK_M = 16
TOKENS = [1, 13, 37]


def problem(num_tokens: int, kind: str, seed: int):
    x = rand(num_tokens, H, seed=seed)
    # skewed: among the first E - 1 experts only, so the last one has no rows at all
    ids = make_ids(kind, num_tokens, E - 1 if kind == "skewed" else E, TOP_K, seed + 1)
    w13 = Fp8Experts.quantize(rand(E, 2 * INTER, H, seed=seed + 2) * 0.05, parts=2)
    w2 = Fp8Experts.quantize(rand(E, H, INTER, seed=seed + 3) * 0.05)
    return x, ids, w13, w2


def quantized_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_ref.per_token_group_quant(a.reshape(-1, a.shape[-1]))


def sum_tolerance(a_q, a_s, w: Fp8Experts, experts: torch.Tensor, n: int, fuse: bool) -> torch.Tensor:
    """``(2 K_pad + 8) 2**-24 * sum_k |a_k w_k|`` per output (per half when fused)."""
    a = fp8_ref.dequantize_activation(a_q, a_s).abs()
    dense = [fp8_ref.dequantize_weight(w.q[e], w.scale[e]).abs() for e in range(w.shape[0])]
    half = w.q.shape[1] // 2
    gate = torch.stack([a[r] @ dense[e][:n].t() for r, e in enumerate(experts.tolist())])
    tol = (2 * a_q.shape[1] + 8) * 2.0**-24
    if not fuse:
        return tol * gate
    up = torch.stack([a[r] @ dense[e][half:half + n].t() for r, e in enumerate(experts.tolist())])
    return tol * (gate * 1.1 * (up + 1) + up * (gate + 1)) + 1e-7


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "elsewhere"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_contiguous_fp8_triton_matches_reference(num_tokens, kind, fuse):
    x, ids, w13, w2 = problem(num_tokens, kind, seed=31 * num_tokens + len(kind))
    w, n = (w13, INTER) if fuse else (w2, H)
    layout = scatter_ref.scatter_contiguous(x if fuse else x[:, :INTER], ids, E, BLOCK_M)
    a = layout.x.clone()
    a[layout.m_indices < 0] = float("nan")  # padding rows: their bytes and scales must not reach a product
    a_q, a_s = quantized_rows(a)
    ref = gemm_ref.grouped_gemm_contiguous_fp8(a_q, a_s, w.q, w.scale, layout.m_indices, BLOCK_M, n=n, fuse_silu_and_mul=fuse)
    tri = gemm_tri.grouped_gemm_contiguous_fp8(a_q, a_s, w.q, w.scale, layout.m_indices, BLOCK_M, n=n, fuse_silu_and_mul=fuse)
    used = layout.m_indices >= 0
    assert tri.shape == ref.shape == (a.shape[0], n) and tri.dtype == torch.float32
    assert not tri[used].isnan().any()
    if not used.any():  # one token whose experts all live elsewhere: nothing to compute
        return
    tol = sum_tolerance(a_q[used], a_s[used], w, layout.m_indices[used], n, fuse)
    assert ((tri[used] - ref[used]).abs() <= tol).all(), (tri[used] - ref[used]).abs().max()


@pytest.mark.parametrize("block_m", [None, 16], ids=["tile_from_max_m", "tile_16"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_masked_fp8_triton_matches_reference(num_tokens, kind, fuse, block_m):
    x, ids, w13, w2 = problem(num_tokens, kind, seed=37 * num_tokens + len(kind))
    w, n = (w13, INTER) if fuse else (w2, H)
    layout = scatter_ref.scatter_masked(x if fuse else x[:, :INTER], ids, E)
    a = layout.x.clone()
    for e, c in enumerate(layout.counts.tolist()):
        a[e, c:] = float("nan")  # rows past the count are undefined
    q, s = quantized_rows(a)
    a_q, a_s = q.view(E, num_tokens, -1), s.view(E, num_tokens, -1)
    ref = gemm_ref.grouped_gemm_masked_fp8(a_q, a_s, w.q, w.scale, layout.counts, n=n, fuse_silu_and_mul=fuse, block_m=block_m)
    tri = gemm_tri.grouped_gemm_masked_fp8(a_q, a_s, w.q, w.scale, layout.counts, n=n, fuse_silu_and_mul=fuse, block_m=block_m)
    assert tri.shape == ref.shape == (E, num_tokens, n)
    if kind == "skewed":
        assert layout.counts[-1] == 0  # an idle expert
    for e, c in enumerate(layout.counts.tolist()):
        if c:
            tol = sum_tolerance(a_q[e, :c], a_s[e, :c], w, torch.full((c,), e), n, fuse)
            assert ((tri[e, :c] - ref[e, :c]).abs() <= tol).all(), (e, (tri[e, :c] - ref[e, :c]).abs().max())


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_quantization_inside_the_gemm_is_bit_identical(masked):
    """``a_s=None``: the GEMM quantizes the unquantized rows it reads (in registers, with the
    quantization kernel's arithmetic): the very bits of quantizing first, then the GEMM."""
    x, ids, w13, _ = problem(29, "skewed", seed=8)
    for impl in (gemm_tri, gemm_ref):
        if masked:
            layout = scatter_ref.scatter_masked(x, ids, E)
            q, s = quantized_rows(layout.x)
            a_q, a_s = q.view(E, 29, -1), s.view(E, 29, -1)
            pre = impl.grouped_gemm_masked_fp8(a_q, a_s, w13.q, w13.scale, layout.counts, n=INTER, fuse_silu_and_mul=True)
            raw = impl.grouped_gemm_masked_fp8(layout.x, None, w13.q, w13.scale, layout.counts, n=INTER, fuse_silu_and_mul=True)
            used = torch.arange(29)[None, :] < layout.counts[:, None]
        else:
            layout = scatter_ref.scatter_contiguous(x, ids, E, BLOCK_M)
            a_q, a_s = quantized_rows(layout.x)
            pre = impl.grouped_gemm_contiguous_fp8(a_q, a_s, w13.q, w13.scale, layout.m_indices, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
            raw = impl.grouped_gemm_contiguous_fp8(layout.x, None, w13.q, w13.scale, layout.m_indices, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
            used = layout.m_indices >= 0
        assert used.any() and torch.equal(pre[used], raw[used]), impl.__name__


def test_reference_within_e4m3_bound_of_the_exact_product():
    x, ids, _, _ = problem(29, "uniform", seed=5)
    w = rand(E, INTER, H, seed=6) * 0.05
    experts = Fp8Experts.quantize(w)
    layout = scatter_ref.scatter_contiguous(x, ids, E, BLOCK_M)
    a_q, a_s = quantized_rows(layout.x)
    y = gemm_ref.grouped_gemm_contiguous_fp8(a_q, a_s, experts.q, experts.scale, layout.m_indices, BLOCK_M, n=INTER)
    err_max = 0.0
    for e in range(E):
        rows = torch.nonzero(layout.m_indices == e).squeeze(1)
        if rows.numel() == 0:
            continue
        a, we = layout.x[rows].double(), w[e].double()
        ea = elementwise_error(a, activation_scales(a_s[rows], rows.numel(), H)).double()
        ew = elementwise_error(we, weight_scales(experts.scale[e], INTER, H)).double()
        bound = ea @ we.abs().t() + (a.abs() + ea) @ ew.t() + 2.0**-20 * (a.abs() @ we.abs().t())
        err = (y[rows].double() - a @ we.t()).abs()
        assert (err <= bound).all()
        err_max = max(err_max, err.max().item())
    assert err_max > 0  # quantized: exactness would mean nothing was compared


@pytest.mark.parametrize("impl", [gemm_ref, gemm_tri], ids=["reference", "triton"])
def test_operands_are_checked_with_clear_errors(impl):
    _, _, w13, w2 = problem(1, "uniform", seed=1)
    a_q, a_s = fp8_ref.per_token_group_quant(torch.randn(32, H))
    m_idx = torch.zeros(32, dtype=torch.int32)
    run = impl.grouped_gemm_contiguous_fp8
    with pytest.raises(Fp8AlignmentError, match="K_pad"):  # activations of w2's K against w13
        run(*fp8_ref.per_token_group_quant(torch.randn(32, 300)), w13.q, w13.scale, m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="n \\(129\\) must be in 1..128"):  # past the gate half
        run(a_q, a_s, w13.q, w13.scale, m_idx, BLOCK_M, n=129, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="two halves"):
        run(a_q, a_s, w2.q[:, :128], w2.scale[:, :1], m_idx, BLOCK_M, n=8, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="activation scale"):
        run(a_q, a_s[:, :1], w13.q, w13.scale, m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="expert weight scale"):
        run(a_q, a_s, w13.q, w13.scale[:, :1], m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="3-D"):
        run(a_q, a_s, w13.q[0], w13.scale[0], m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="activation must be a torch.float8"):
        run(a_q.float(), a_s, w13.q, w13.scale, m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="unquantized float tensor"):  # no scales: the GEMM quantizes
        run(a_q, None, w13.q, w13.scale, m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(Fp8AlignmentError, match="K_pad"):
        run(torch.randn(32, 300), None, w13.q, w13.scale, m_idx, BLOCK_M, n=INTER, fuse_silu_and_mul=True)
    with pytest.raises(ValueError, match="multiple of block_m"):
        run(a_q[:20], a_s[:20], w13.q, w13.scale, m_idx[:20], BLOCK_M, n=INTER, fuse_silu_and_mul=True)


# -- expert weights ---------------------------------------------------------------------------


def test_expert_weights_round_trip_within_e4m3_error():
    w = rand(E, 2 * INTER, H, seed=11)
    experts = Fp8Experts.quantize(w, parts=2)
    i_pad, h_pad = padded(INTER), padded(H)
    assert experts.q.dtype == FP8_DTYPE and experts.q.shape == (E, 2 * i_pad, h_pad)
    assert experts.scale.dtype == torch.float32 and experts.scale.shape == (E, 2 * i_pad // BLOCK, h_pad // BLOCK)
    assert experts.shape == (E, 2 * INTER, H) and experts.parts == 2
    back = experts.dequantize()
    for e in range(E):
        for half in range(2):  # each half has its own blocks: up starts at a block edge
            rows = slice(half * INTER, (half + 1) * INTER)
            s = weight_scales(experts.scale[e, half * i_pad // BLOCK:(half + 1) * i_pad // BLOCK], INTER, H)
            assert ((back[e, rows] - w[e, rows]).abs() <= elementwise_error(w[e, rows], s)).all()
    assert not torch.equal(back, w)
    assert (experts.q.view(torch.uint8)[:, INTER:i_pad] == 0).all() and (experts.q.view(torch.uint8)[:, :, H:] == 0).all()


def test_checkpoint_parts_stack_to_the_quantized_at_load_bytes():
    """An FP8 checkpoint's per-expert gate/up/down (unpadded e4m3 + ``weight_scale_inv``)
    stack into the very bytes that quantizing the float experts at load gives."""
    w = rand(E, 2 * INTER, H, seed=12)
    at_load = Fp8Experts.quantize(w, parts=2)
    parts = []
    for e in range(E):
        expert = []
        for p in w[e].chunk(2):
            q, s = fp8_ref.quantize_weight(p)
            expert.append(Fp8Weight.from_checkpoint(q[:INTER, :H].contiguous(), s))
        parts.append(expert)
    stacked = Fp8Experts.stack(parts)
    assert torch.equal(stacked.q.view(torch.uint8), at_load.q.view(torch.uint8)) and torch.equal(stacked.scale, at_load.scale)
    with pytest.raises(ValueError, match="same parts"):
        Fp8Experts.stack([parts[0], parts[1][:1]])


def test_expert_weights_move_but_are_never_cast():
    experts = Fp8Experts.quantize(rand(2, 64, 64, seed=13))
    holder = torch.nn.ModuleDict({"w": experts}).to(dtype=torch.bfloat16)
    assert holder["w"].q.dtype == FP8_DTYPE and holder["w"].scale.dtype == torch.float32


# -- executors and their selection with FP8 experts --------------------------------------------


def first_principles(x, routing, w13: Fp8Experts, w2: Fp8Experts) -> torch.Tensor:
    """Each routed pair by hand: activations quantized and dequantized per token group
    before each GEMM, the dequantized weights, SwiGLU, the router-weighted sum."""
    qdq = lambda a: fp8_ref.dequantize_activation(*fp8_ref.per_token_group_quant(a))[:, : a.shape[1]]  # noqa: E731
    d13, d2 = w13.dequantize(), w2.dequantize()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(routing.ids[t].tolist()):
            if 0 <= e < E:
                h = qdq(x[t : t + 1]) @ d13[e].t()
                act = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
                out[t] += routing.weights[t, j] * (qdq(act) @ d2[e].t())[0]
    return out


@pytest.mark.parametrize("kind", ["uniform", "skewed", "elsewhere"])
@pytest.mark.parametrize("name", ["contiguous", "masked"])
def test_grouped_executors_run_fp8_experts(name, kind):
    from kernels.moe.select import reference_moe_ops, triton_moe_ops
    from libs.model.moe import executors as ex
    from libs.model.moe.routing import Routing

    if name == "masked" and kind == "elsewhere":
        pytest.skip("the masked layout takes local ids only (EP dispatches before it)")
    x, ids, w13, w2 = problem(21, kind, seed=3 + len(kind))
    routing = Routing(torch.rand(21, TOP_K, generator=torch.Generator().manual_seed(4)), ids)
    kind_cls = ex.ContiguousExecutor if name == "contiguous" else ex.MaskedExecutor
    ref = kind_cls(reference_moe_ops())(x, routing, w13, w2)
    torch.testing.assert_close(ref, first_principles(x, routing, w13, w2), atol=1e-4, rtol=1e-4)
    tri = kind_cls(triton_moe_ops())(x, routing, w13, w2)
    torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-4)
    assert kind_cls(reference_moe_ops())(x[:0], Routing(routing.weights[:0], ids[:0]), w13, w2).shape == (0, H)


def test_selection_with_fp8_experts_on_the_cpu():
    from libs.model.moe import executors as ex
    from libs.model.moe.strategy import LayerShape, select_executor

    shape, cpu = LayerShape(E, TOP_K, H, INTER), torch.device("cpu")
    auto = select_executor("auto", cpu, torch.float32, shape, fp8=True)
    assert auto.executor.name == "contiguous" and "reference FP8" in auto.reason
    for dense_only in ("loop", "grouped_mm"):
        sel = select_executor(dense_only, cpu, torch.bfloat16, shape, fp8=True)
        assert sel.executor.name == "contiguous" and "dense expert weights only" in sel.reason
    for grouped in ("contiguous", "masked", "hybrid"):
        sel = select_executor(grouped, cpu, torch.float32, shape, fp8=True)
        assert sel.executor.name == grouped and sel.executor.runs_fp8
    x, ids, w13, w2 = problem(3, "uniform", seed=9)
    from libs.model.moe.routing import Routing

    with pytest.raises(TypeError, match="dense weights only"):
        ex.LoopExecutor()(x, Routing(torch.ones(3, TOP_K), ids), w13, w2)


def test_older_gpus_get_reference_fp8_gemms_with_triton_scatter(monkeypatch):
    """A CUDA GPU without FP8 tensor cores (SM 8.0): Triton scatter and combine, the
    reference FP8 GEMMs, and an executor that refuses CUDA-graph capture."""
    from kernels.moe import select
    from libs.model.moe import strategy
    from libs.model.moe.strategy import LayerShape, select_executor

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(select, "fp8_gemm_supported", lambda d: False)
    monkeypatch.setattr(strategy, "fp8_gemm_supported", lambda d: False)
    monkeypatch.setattr(strategy, "triton_usable", lambda d: True)
    ops = select.moe_ops_for(cuda, fp8=True)
    assert ops.scatter_contiguous is select.triton_moe_ops().scatter_contiguous
    assert ops.grouped_gemm_contiguous_fp8 is select.reference_moe_ops().grouped_gemm_contiguous_fp8
    sel = select_executor("auto", cuda, torch.bfloat16, LayerShape(E, TOP_K, H, INTER), fp8=True)
    assert sel.executor.name == "contiguous" and not sel.executor.graph_safe and "SM 8.9" in sel.reason
    monkeypatch.setattr(select, "fp8_gemm_supported", lambda d: True)
    monkeypatch.setattr(strategy, "fp8_gemm_supported", lambda d: True)
    assert select.moe_ops_for(cuda, fp8=True) is select.triton_moe_ops()
    sel = select_executor("auto", cuda, torch.bfloat16, LayerShape(E, TOP_K, H, INTER), fp8=True)
    assert sel.executor.name == "hybrid" and sel.executor.graph_safe and "Triton FP8" in sel.reason
