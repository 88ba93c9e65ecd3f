"""MoE kernels (kernels/moe): ep_scatter, combine and the grouped GEMMs, Triton against the
torch references on fresh random inputs, and the references against first principles.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py), in fp32 (its
bf16 arithmetic is not the GPU's), at small sizes; tests/gpu/test_moe_gpu.py runs bf16 at
real layer shapes. Token counts: 0, 1, a prime, and one whose busiest expert overflows a
16-row tile; routing: uniform, skewed (some experts idle, one taking most pairs),
balanced (FakeBalanceExpert) and partly routed elsewhere (expert parallelism's ``-1``).

Scatter layouts are deterministic (pair order within an expert), so Triton and reference
are compared exactly; the GEMMs to fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.moe.gemm import reference as gemm_ref  # noqa: E402
from kernels.moe.gemm import triton_gemm as gemm_tri  # noqa: E402
from kernels.moe.scatter import CapacityError, contiguous_capacity  # noqa: E402
from kernels.moe.scatter import reference as scatter_ref  # noqa: E402
from kernels.moe.scatter import triton_scatter as scatter_tri  # noqa: E402
from tests.moe_inputs import ROUTINGS, make_ids  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_M = 16
TOKENS = [0, 1, 13, 37]  # 37 x top-2 over 4 experts: ~18 rows an expert, past one 16-row tile
E, K, H, N = 4, 2, 24, 40


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(num_tokens: int, kind: str, seed: int, hidden: int = H):
    x = torch.randn(num_tokens, hidden, generator=_gen(seed)).to(DEVICE)
    return x, make_ids(kind, num_tokens, E, K, seed + 1).to(DEVICE)


# -- ep_scatter ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_scatter_contiguous_triton_equals_reference(num_tokens, kind):
    x, ids = inputs(num_tokens, kind, seed=10 * num_tokens + len(kind))
    ref = scatter_ref.scatter_contiguous(x, ids, E, BLOCK_M)
    tri = scatter_tri.scatter_contiguous(x, ids, E, BLOCK_M)
    for name in ("m_indices", "dst", "counts", "seg_ends"):
        assert torch.equal(getattr(ref, name), getattr(tri, name)), name
    used = ref.m_indices >= 0
    assert torch.equal(ref.x[used], tri.x[used])
    check_contiguous_layout(ref, x, ids)


def check_contiguous_layout(layout, x: torch.Tensor, ids: torch.Tensor) -> None:
    """From first principles: every routed pair's row holds its token under its expert, in
    pair order, in segments aligned to the tile; everything else is padding (-1)."""
    num_tokens, top_k = ids.shape
    routed = (ids >= 0) & (ids < E)
    assert layout.x.shape[0] == contiguous_capacity(num_tokens, top_k, E, BLOCK_M)
    assert torch.equal(layout.counts.cpu(), torch.bincount(ids[routed].long().cpu(), minlength=E).int())
    assert torch.equal(layout.dst < 0, ~routed)
    dst = layout.dst[routed].long()
    assert len(set(dst.tolist())) == dst.numel(), "two pairs share a row"
    assert torch.equal(layout.m_indices[dst], ids[routed])
    tokens = torch.nonzero(routed)[:, 0]
    assert torch.equal(layout.x[dst], x[tokens])
    assert int((layout.m_indices >= 0).sum()) == dst.numel(), "rows that no pair owns must be -1"
    starts = torch.cat([layout.seg_ends.new_zeros(1), layout.seg_ends[:-1]]).long()
    assert bool((starts % BLOCK_M == 0).all()) and bool((layout.seg_ends.long() % BLOCK_M == 0).all())
    for e in range(E):
        rows = torch.nonzero(layout.m_indices == e).squeeze(1)
        assert torch.equal(rows.cpu(), torch.arange(starts[e], starts[e] + layout.counts[e]).cpu()), "not one segment in pair order"


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_scatter_masked_triton_equals_reference(num_tokens, kind):
    x, ids = inputs(num_tokens, kind, seed=7 * num_tokens + len(kind))
    ref = scatter_ref.scatter_masked(x, ids, E)
    tri = scatter_tri.scatter_masked(x, ids, E)
    assert ref.x.shape == tri.x.shape == (E, num_tokens, H)
    assert torch.equal(ref.dst, tri.dst) and torch.equal(ref.counts, tri.counts)
    routed = (ids >= 0) & (ids < E)
    assert torch.equal(ref.counts.cpu(), torch.bincount(ids[routed].long().cpu(), minlength=E).int())
    flat_ref, flat_tri = ref.x.view(-1, H), tri.x.view(-1, H)
    dst = ref.dst[routed].long()
    assert torch.equal(flat_ref[dst], x[torch.nonzero(routed)[:, 0]]) and torch.equal(flat_tri[dst], flat_ref[dst])
    assert torch.equal(torch.div(dst, num_tokens, rounding_mode="floor"), ids[routed].long())


@pytest.mark.parametrize("impl", [scatter_ref, scatter_tri], ids=["reference", "triton"])
def test_capacities_are_checked_never_overrun(impl):
    x, ids = inputs(37, "skewed", seed=3)
    need = int(((torch.bincount(ids.long().flatten().cpu(), minlength=E) + BLOCK_M - 1) // BLOCK_M * BLOCK_M).sum())
    bound = contiguous_capacity(37, K, E, BLOCK_M)
    assert need < bound
    exact = impl.scatter_contiguous(x, ids, E, BLOCK_M, capacity=need)  # below the bound, checked, enough
    assert exact.x.shape[0] == need and torch.equal(exact.dst, impl.scatter_contiguous(x, ids, E, BLOCK_M).dst)
    with pytest.raises(CapacityError, match=f"needs {need} rows"):
        impl.scatter_contiguous(x, ids, E, BLOCK_M, capacity=need - BLOCK_M)
    with pytest.raises(CapacityError, match="multiple of block_m"):
        impl.scatter_contiguous(x, ids, E, BLOCK_M, capacity=need + 1)
    busiest = int(torch.bincount(ids.long().flatten().cpu(), minlength=E).max())
    assert impl.scatter_masked(x, ids, E, max_m=busiest).x.shape == (E, busiest, H)
    with pytest.raises(CapacityError, match=f"max_m >= {busiest}"):
        impl.scatter_masked(x, ids, E, max_m=busiest - 1)


@pytest.mark.parametrize("impl", [scatter_ref, scatter_tri], ids=["reference", "triton"])
def test_masked_repeated_ids_are_dropped_not_written_out_of_bounds(impl):
    """``max_m = T`` assumes distinct ids per token; repeated ids past it are dropped
    (``dst -1``, counts clipped), never written past the expert's rows."""
    x = torch.randn(3, H, generator=_gen(5)).to(DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)  # 6 pairs to expert 0, max_m = 3
    layout = impl.scatter_masked(x, ids, E)
    assert layout.counts.tolist() == [3, 0, 0, 0]
    assert layout.dst.flatten().tolist() == [0, 1, 2, -1, -1, -1]
    assert torch.equal(layout.x[0], x[[0, 0, 1]])  # pairs (0,0), (0,1), (1,0)


# -- combine --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_combine_triton_equals_reference(num_tokens, kind):
    x, ids = inputs(num_tokens, kind, seed=11 * num_tokens + len(kind))
    layout = scatter_ref.scatter_contiguous(x, ids, E, BLOCK_M)
    g = _gen(num_tokens + 99)
    y = torch.randn(layout.x.shape[0], H, generator=g).to(DEVICE)
    y[layout.m_indices < 0] = float("nan")  # padding rows are never read
    w = torch.rand(num_tokens, K, generator=g).to(DEVICE)
    ref = scatter_ref.combine(y, layout.dst, w)
    tri = scatter_tri.combine(y, layout.dst, w)
    assert ref.shape == tri.shape == (num_tokens, H)
    torch.testing.assert_close(tri, ref, atol=1e-6, rtol=1e-6)
    expected = torch.zeros(num_tokens, H, device=DEVICE)
    for t in range(num_tokens):
        for j in range(K):
            if layout.dst[t, j] >= 0:
                expected[t] += w[t, j] * y[layout.dst[t, j]]
    torch.testing.assert_close(ref, expected, atol=1e-6, rtol=1e-6)


# -- grouped GEMMs --------------------------------------------------------------------------


def _weights(n_rows: int, k_dim: int, seed: int) -> torch.Tensor:
    return (torch.randn(E, n_rows, k_dim, generator=_gen(seed)) / k_dim**0.5).to(DEVICE)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "elsewhere"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_grouped_gemm_contiguous_triton_equals_reference(num_tokens, kind, fuse):
    x, ids = inputs(num_tokens, kind, seed=13 * num_tokens + len(kind))
    layout = scatter_ref.scatter_contiguous(x, ids, E, BLOCK_M)
    a = layout.x.clone()
    a[layout.m_indices < 0] = float("nan")  # padding rows must not reach a product
    w = _weights(2 * N if fuse else N, H, seed=num_tokens)
    ref = gemm_ref.grouped_gemm_contiguous(a, w, layout.m_indices, BLOCK_M, fuse)
    tri = gemm_tri.grouped_gemm_contiguous(a, w, layout.m_indices, BLOCK_M, fuse)
    used = layout.m_indices >= 0
    assert tri.shape == ref.shape == (a.shape[0], N)
    assert not tri[used].isnan().any()
    torch.testing.assert_close(tri[used], ref[used], atol=2e-5, rtol=2e-5)
    for r in torch.nonzero(used).squeeze(1).tolist()[:5]:  # and the reference from first principles
        h = w[layout.m_indices[r]] @ a[r]
        want = torch.nn.functional.silu(h[:N]) * h[N:] if fuse else h
        torch.testing.assert_close(ref[r], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [None, 16], ids=["tile_from_max_m", "tile_16"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "balanced"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_grouped_gemm_masked_triton_equals_reference(num_tokens, kind, fuse, block_m):
    x, ids = inputs(num_tokens, kind, seed=17 * num_tokens + len(kind))
    layout = scatter_ref.scatter_masked(x, ids, E)
    a = layout.x.clone()
    for e, c in enumerate(layout.counts.tolist()):
        a[e, c:] = float("nan")  # rows past the count are undefined
    w = _weights(2 * N if fuse else N, H, seed=num_tokens + 1)
    ref = gemm_ref.grouped_gemm_masked(a, w, layout.counts, fuse, block_m)
    tri = gemm_tri.grouped_gemm_masked(a, w, layout.counts, fuse, block_m)  # 16: several tiles an expert
    assert tri.shape == ref.shape == (E, num_tokens, N)
    for e, c in enumerate(layout.counts.tolist()):
        assert not tri[e, :c].isnan().any()
        torch.testing.assert_close(tri[e, :c], ref[e, :c], atol=2e-5, rtol=2e-5)


def test_gemm_shape_errors():
    a = torch.zeros(32, H, device=DEVICE)
    m = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    for impl in (gemm_ref, gemm_tri):
        with pytest.raises(ValueError, match="multiple of block_m"):
            impl.grouped_gemm_contiguous(a[:20], _weights(N, H, 0), m[:20], BLOCK_M)
        with pytest.raises(ValueError, match="K"):
            impl.grouped_gemm_contiguous(a, _weights(N, H + 1, 0), m, BLOCK_M)
        with pytest.raises(ValueError, match="2N rows"):
            impl.grouped_gemm_contiguous(a, _weights(N + 1, H, 0), m, BLOCK_M, True)


def test_empty_batch_launches_nothing(monkeypatch):
    """T = 0: empty layouts and a [0, H] output, without a zero-size grid."""

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"launched a kernel with grid {grid} for an empty batch")

    for name in ("_count_kernel", "_contiguous_dst_kernel", "_masked_dst_kernel", "_scatter_rows_kernel", "_combine_kernel"):
        monkeypatch.setattr(scatter_tri, name, NoLaunch())
    monkeypatch.setattr(gemm_tri, "_grouped_gemm_kernel", NoLaunch())
    x, ids = inputs(0, "uniform", seed=0)
    lay = scatter_tri.scatter_contiguous(x, ids, E, BLOCK_M)
    assert lay.x.shape == (0, H) and lay.counts.tolist() == [0] * E
    assert gemm_tri.grouped_gemm_contiguous(lay.x, _weights(N, H, 0), lay.m_indices, BLOCK_M).shape == (0, N)
    masked = scatter_tri.scatter_masked(x, ids, E)
    assert masked.x.shape == (E, 0, H)
    assert gemm_tri.grouped_gemm_masked(masked.x, _weights(N, H, 0), masked.counts).shape == (E, 0, N)
    out = scatter_tri.combine(torch.zeros(0, H, device=DEVICE), lay.dst, torch.zeros(0, K, device=DEVICE))
    assert out.shape == (0, H)
