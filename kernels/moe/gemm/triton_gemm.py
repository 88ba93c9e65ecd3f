"""Triton grouped GEMMs: the GPU path behind ``kernels/moe/gemm/reference.py``.

One kernel serves both layouts (``MASKED`` is a compile-time switch). A program computes a
``BLOCK_M x BLOCK_N`` tile of one expert's output; programs are numbered in groups of
``GROUP_M`` row tiles so neighbours share weight tiles in L2 (the usual grouped ordering).

- contiguous: the tile's expert is ``m_indices`` of its first row (segments are aligned to
  ``BLOCK_M`` by the scatter, so a tile never spans two experts); a ``-1`` there means the
  tile is all padding and the program returns at once. Padding rows inside a tile are
  masked out of loads and stores (``m_indices[row] != expert``), so undefined padding
  contents never enter a product.
- masked: program ``(e, tile)`` returns at once when ``tile * BLOCK_M >= counts[e]``; rows
  past the count are masked. Decode sizes launch ``E * cdiv(max_m, BLOCK_M)`` row tiles, of
  which only the busy ones do work.

``FUSE_SILU``: two accumulators (the gate columns ``n`` and the up columns ``N + n``) and
SwiGLU in the epilogue (``kernels/activation``'s ``swiglu``), rounded exactly as the
unfused product followed by ``silu_and_mul``: the ``[M, 2N]`` intermediate never goes
through memory.

``FP8`` (``grouped_gemm_contiguous_fp8`` / ``grouped_gemm_masked_fp8``): e4m3 operands in
the block-scaled format (kernels/fp8/layout.py), K padded to 128 and stepped by 128, the
block edge, so each step's scales are one per row of the activations (its token group)
and one per column of the weight (its 128-row block, loaded per column, so the up half's
offset need not be a tile multiple): the step's MMA partial sum (fp32 out) is scaled and
added to the fp32 accumulator, as in the dense FP8 GEMM (kernels/fp8/triton_gemm.py). The
fused SwiGLU's up rows start at ``up_offset`` (``N_pad / 2`` for FP8, where each half is
padded on its own; ``N`` for the dense weights). Loads of padding rows are masked, so
neither undefined activation bytes nor their scales enter a product. ``A_RAW`` (the
wrappers' ``a_s=None``): the activations arrive unquantized and each program quantizes the
``[BLOCK_M, 128]`` group it reads in registers with kernels/fp8's ``quantize_groups`` (the
quantization kernel's own arithmetic, so the bits are the same): no separate launch, and
in the masked layout only busy experts' rows are quantized, not the whole ``[E, max_m, K]``
buffer; every N tile re-quantizes its rows, cheap for decode-sized batches.

fp32 inputs are multiplied in IEEE fp32 (not TF32), so they match the reference to
summation order. Block sizes come from ``gemm_config``, a heuristic: it has not been tuned
on a GPU yet (bench/moe_bench.py measures it). The wrappers never read device memory on the
host, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.activation.triton_activation import swiglu
from kernels.fp8.layout import BLOCK as FP8_BLOCK
from kernels.fp8.layout import E4M3_MAX, FP8_DTYPE, FP32_MAX, SCALE_EPS
from kernels.fp8.triton_quant import quantize_groups
from kernels.moe.gemm.reference import check_contiguous, check_contiguous_fp8, check_gemm_inputs, check_masked, check_masked_fp8


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_config(block_m: int, n: int, k: int, fuse_silu_and_mul: bool, dtype: torch.dtype) -> GemmConfig:
    """Tile sizes for one problem: 64/128-wide N tiles (64 with two accumulators), 64-deep K
    tiles for 16-bit inputs (32 for fp32), never wider than the problem (min 16, tl.dot's).
    FP8: 128-deep K tiles, one scale block per step."""
    block_n = min(64 if fuse_silu_and_mul or block_m >= 128 else 128, max(16, triton.next_power_of_2(n)))
    if dtype == FP8_DTYPE:
        block_k = FP8_BLOCK
    else:
        block_k = min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(k)))
    num_warps = 8 if block_m * block_n >= 128 * 64 else 4
    return GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=3)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, m_indices_ptr, counts_ptr, as_ptr, ws_ptr,
    num_row_tiles, n_out, k_dim, max_m, up_offset, a_k,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    stride_asm, stride_wse, stride_wsn, eps, fp32_max, fp8_max,
    MASKED: tl.constexpr, FUSE_SILU: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, A_RAW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_row_tiles - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size

    offs_m = tl.arange(0, BLOCK_M)
    if MASKED:
        tiles_per_expert = tl.cdiv(max_m, BLOCK_M)
        expert = tile_m // tiles_per_expert
        row0 = (tile_m % tiles_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + expert), max_m)
        if row0 >= count:
            return
        rows = expert.to(tl.int64) * max_m + row0 + offs_m
        row_ok = row0 + offs_m < count
    else:
        expert = tl.load(m_indices_ptr + tile_m * BLOCK_M)
        if expert < 0:
            return
        rows = tile_m.to(tl.int64) * BLOCK_M + offs_m
        row_ok = tl.load(m_indices_ptr + rows) == expert

    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FP8:
        # Scales: one per row and K block (activations), one per column's 128-row block
        # and K block (weights); the K block index is added per step.
        as_ptrs = as_ptr + rows * stride_asm
        ws_base = ws_ptr + expert.to(tl.int64) * stride_wse
        ws_ptrs = ws_base + (cols // BLOCK_K) * stride_wsn
        ws_up_ptrs = ws_base + ((cols + up_offset) // BLOCK_K) * stride_wsn
    for k0 in range(0, k_dim, BLOCK_K):
        if FP8:  # K is padded to whole 128-blocks: no K mask
            kb = k0 // BLOCK_K
            if A_RAW:  # unquantized rows of a_k columns: quantized here, one group per step
                a_raw = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < a_k - k0)[None, :], other=0.0).to(tl.float32)
                a_grid, a_s = quantize_groups(a_raw, 1, eps, fp32_max, fp8_max)
                a = a_grid.to(tl.float8e4nv)  # exact: the values are on e4m3's grid
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32) * a_s[:, None] * w_s[None, :]
            if FUSE_SILU:
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=col_ok[None, :], other=0.0)
                w_up_s = tl.load(ws_up_ptrs + kb, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, w_up, out_dtype=tl.float32) * a_s[:, None] * w_up_s[None, :]
        else:
            k_ok = offs_k < k_dim - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if FUSE_SILU:
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    out_ty = c_ptr.dtype.element_ty
    if FUSE_SILU:
        out = swiglu(acc, acc_up, out_ty)
    else:
        out = acc.to(out_ty)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def _launch(
    a2d, w, c2d, m_indices, counts, num_row_tiles, max_m, n_out, masked, fuse, cfg: GemmConfig,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``scales``: FP8 operands' ``(a_s [rows, K_pad/128], w_s [E, N_pad/128, K_pad/128])``;
    ``a_s`` None: ``a2d`` is unquantized and the kernel quantizes it."""
    grid = (num_row_tiles * triton.cdiv(n_out, cfg.block_n),)
    fp8 = scales is not None
    a_s, w_s = scales if fp8 else (None, w)
    raw = fp8 and a_s is None
    a_s = a2d if a_s is None else a_s  # unread without pre-quantized FP8 activations
    up_offset = w.shape[1] // 2 if fp8 else n_out
    _grouped_gemm_kernel[grid](
        a2d, w, c2d, m_indices, counts, a_s, w_s,
        num_row_tiles, n_out, w.shape[2], max_m, up_offset, a2d.shape[1],
        a2d.stride(0), a2d.stride(1), w.stride(0), w.stride(1), w.stride(2), c2d.stride(0), c2d.stride(1),
        a_s.stride(0) if fp8 else 0, w_s.stride(0) if fp8 else 0, w_s.stride(1) if fp8 else 0, SCALE_EPS, FP32_MAX, E4M3_MAX,
        MASKED=masked, FUSE_SILU=fuse, PRECISION="ieee" if a2d.dtype == torch.float32 else "tf32", FP8=fp8, A_RAW=raw,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def grouped_gemm_contiguous(
    a: torch.Tensor, w: torch.Tensor, m_indices: torch.Tensor, block_m: int, fuse_silu_and_mul: bool = False
) -> torch.Tensor:
    n = check_gemm_inputs(a, w, fuse_silu_and_mul)
    check_contiguous(a, m_indices, block_m)
    c = torch.empty((a.shape[0], n), dtype=a.dtype, device=a.device)
    if a.shape[0] == 0 or n == 0:
        return c
    cfg = gemm_config(block_m, n, w.shape[2], fuse_silu_and_mul, a.dtype)
    _launch(a, w, c, m_indices.to(torch.int32), m_indices, a.shape[0] // block_m, 0, n, False, fuse_silu_and_mul, cfg)
    return c


def grouped_gemm_masked(
    a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, fuse_silu_and_mul: bool = False, block_m: int | None = None
) -> torch.Tensor:
    """``block_m``: M tile, a power of two in [16, 64] (default from ``max_m``). Pass the rows an
    expert typically gets: a tile past an expert's count exits at once, a half-empty one
    still multiplies every row."""
    n = check_gemm_inputs(a, w, fuse_silu_and_mul)
    check_masked(a, w, counts)
    num_experts, max_m, _ = a.shape
    c = torch.empty((num_experts, max_m, n), dtype=a.dtype, device=a.device)
    if max_m == 0 or n == 0:
        return c
    block_m = min(64, max(16, triton.next_power_of_2(block_m or max_m)))
    cfg = gemm_config(block_m, n, w.shape[2], fuse_silu_and_mul, a.dtype)
    a2d = a.reshape(num_experts * max_m, a.shape[2])
    _launch(a2d, w, c.view(num_experts * max_m, n), counts, counts.to(torch.int32), num_experts * triton.cdiv(max_m, block_m), max_m, n, True, fuse_silu_and_mul, cfg)
    return c


def grouped_gemm_contiguous_fp8(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, m_indices: torch.Tensor, block_m: int,
    *, n: int, fuse_silu_and_mul: bool = False, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    check_contiguous_fp8(a_q, a_s, w_q, w_s, m_indices, block_m, n, fuse_silu_and_mul)
    c = torch.empty((a_q.shape[0], n), dtype=out_dtype, device=a_q.device)
    if a_q.shape[0] == 0:
        return c
    cfg = gemm_config(block_m, n, w_q.shape[2], fuse_silu_and_mul, FP8_DTYPE)  # a_s None: a_q is unquantized
    _launch(a_q, w_q, c, m_indices.to(torch.int32), m_indices, a_q.shape[0] // block_m, 0, n, False, fuse_silu_and_mul, cfg, (a_s, w_s))
    return c


def grouped_gemm_masked_fp8(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, counts: torch.Tensor,
    *, n: int, fuse_silu_and_mul: bool = False, out_dtype: torch.dtype = torch.float32, block_m: int | None = None,
) -> torch.Tensor:
    """``block_m``: as in ``grouped_gemm_masked``. ``a_s`` None: ``a_q`` is unquantized and
    each program quantizes the rows it reads (busy experts' rows only, not the layout's)."""
    num_experts, max_m, k = check_masked_fp8(a_q, a_s, w_q, w_s, counts, n, fuse_silu_and_mul)
    c = torch.empty((num_experts, max_m, n), dtype=out_dtype, device=a_q.device)
    if max_m == 0:
        return c
    block_m = min(64, max(16, triton.next_power_of_2(block_m or max_m)))
    cfg = gemm_config(block_m, n, w_q.shape[2], fuse_silu_and_mul, FP8_DTYPE)
    rows = num_experts * max_m
    _launch(
        a_q.view(rows, k), w_q, c.view(rows, n), counts, counts.to(torch.int32), num_experts * triton.cdiv(max_m, block_m),
        max_m, n, True, fuse_silu_and_mul, cfg, (None if a_s is None else a_s.view(rows, -1), w_s),
    )
    return c
