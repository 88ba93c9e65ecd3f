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
SwiGLU in the epilogue, rounded exactly as the unfused product followed by
``kernels/activation``'s ``silu_and_mul`` (product to the output dtype, silu to the output
dtype, then the multiply): the ``[M, 2N]`` intermediate never goes through memory.

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

from kernels.moe.gemm.reference import check_contiguous, check_gemm_inputs, check_masked


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_config(block_m: int, n: int, k: int, fuse_silu_and_mul: bool, dtype: torch.dtype) -> GemmConfig:
    """Tile sizes for one problem: 64/128-wide N tiles (64 with two accumulators), 64-deep K
    tiles for 16-bit inputs (32 for fp32), never wider than the problem (min 16, tl.dot's)."""
    block_n = min(64 if fuse_silu_and_mul or block_m >= 128 else 128, max(16, triton.next_power_of_2(n)))
    block_k = min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(k)))
    num_warps = 8 if block_m * block_n >= 128 * 64 else 4
    return GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=3)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, m_indices_ptr, counts_ptr,
    num_row_tiles, n_out, k_dim, max_m,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    MASKED: tl.constexpr, FUSE_SILU: tl.constexpr, PRECISION: tl.constexpr,
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
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if FUSE_SILU:
            w_up = tl.load(w_ptrs + n_out * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    out_ty = c_ptr.dtype.element_ty
    if FUSE_SILU:
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        out = (act * up).to(out_ty)
    else:
        out = acc.to(out_ty)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def _launch(a2d, w, c2d, m_indices, counts, num_row_tiles, max_m, n_out, masked, fuse, cfg: GemmConfig) -> None:
    grid = (num_row_tiles * triton.cdiv(n_out, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a2d, w, c2d, m_indices, counts,
        num_row_tiles, n_out, w.shape[2], max_m,
        a2d.stride(0), a2d.stride(1), w.stride(0), w.stride(1), w.stride(2), c2d.stride(0), c2d.stride(1),
        MASKED=masked, FUSE_SILU=fuse, PRECISION="ieee" if a2d.dtype == torch.float32 else "tf32",
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
