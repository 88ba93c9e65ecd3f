"""Triton block-scaled FP8 GEMM, with a swap-AB variant for few tokens: the GPU side of
``kernels/fp8/reference.py::block_scaled_mm``, same signature.

``Y [M, N] = sum over K blocks b of (Xq[:, b] @ Wq[:, b]^T) * x_s[:, b] * w_s[n // 128, b]``

One kernel, written over a *left* operand ``L`` and a *right* operand ``R`` (both
row-major ``[rows, K_pad]`` e4m3, K contiguous), each with a per-row scale that changes
every 128 rows (``L_GROUP`` / ``R_GROUP``: 1 for the tokens, 128 for the weight):

- normal: ``L = X`` (tokens fill the MMA's M dimension), ``R = W``; a program owns a
  ``[token_tile, weight_tile]`` tile of Y;
- swap-AB: ``L = W``, ``R = X``: the kernel computes ``Y^T = W X^T`` and writes it through
  transposed output strides, i.e. ``(W X^T)^T``. At decode sizes (M of 1 to 16) the
  weight's rows fill the MMA's M dimension, which is 64 rows per warpgroup on Hopper,
  and the few tokens its N dimension (as small as 8), instead of a 64-row tile of which
  M rows are real.

The K loop steps by 128, the block edge, so each step's scales are one value per row of
L and one per row of R: the MMA's fp32 partial sum of one block is scaled and added to an
fp32 accumulator in registers. That is also the "promotion" DeepSeek-V3 describes: the
tensor core's FP8 accumulation (about 14 bits on Hopper) only ever sums 128 products.

Operands arrive padded (kernels/fp8/layout.py): rows of X to the plan's token tile, rows
of W and K to 128, so every load is a whole tile and needs no mask; only the store is
masked to the real ``[m, n]``. ``check_gemm_operands`` enforces this before the launch.

The wrapper never reads device memory on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8.layout import BLOCK, GemmPlan, check_gemm_operands, plan_gemm

# Programs that share a row band of L run next to each other, so R's tiles they all read
# are still in L2 (Triton's grouped ordering).
_GROUP_L = 8


@triton.jit
def _block_scaled_mm_kernel(
    l_ptr, r_ptr, ls_ptr, rs_ptr, c_ptr,
    L_ROWS, R_ROWS, K, l_valid, r_valid,
    stride_l, stride_r, stride_ls, stride_rs, stride_c_l, stride_c_r,
    L_GROUP: tl.constexpr, R_GROUP: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_L: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_l = L_ROWS // BLOCK_L
    tiles_r = R_ROWS // BLOCK_R
    per_group = GROUP_L * tiles_r
    first_l = (pid // per_group) * GROUP_L
    group_size = tl.minimum(tiles_l - first_l, GROUP_L)
    pid_l = first_l + (pid % per_group) % group_size
    pid_r = (pid % per_group) // group_size

    offs_l = (pid_l * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    l_ptrs = l_ptr + offs_l[:, None] * stride_l + offs_k[None, :]
    r_ptrs = r_ptr + offs_r[None, :] * stride_r + offs_k[:, None]  # [BLOCK_K, BLOCK_R]: R^T
    ls_ptrs = ls_ptr + (offs_l // L_GROUP) * stride_ls
    rs_ptrs = rs_ptr + (offs_r // R_GROUP) * stride_rs

    acc = tl.zeros((BLOCK_L, BLOCK_R), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(l_ptrs)
        b = tl.load(r_ptrs)
        a_s = tl.load(ls_ptrs + kb)
        b_s = tl.load(rs_ptrs + kb)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
        l_ptrs += BLOCK_K
        r_ptrs += BLOCK_K

    c_ptrs = c_ptr + offs_l[:, None] * stride_c_l + offs_r[None, :] * stride_c_r
    mask = (offs_l[:, None] < l_valid) & (offs_r[None, :] < r_valid)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def block_scaled_mm(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    m: int,
    n: int,
    out_dtype: torch.dtype = torch.float32,
    plan: GemmPlan | None = None,
) -> torch.Tensor:
    """``Y [m, n] = dequant(X) @ dequant(W)^T``, fp32 accumulation, scales per block.

    ``x_q``/``x_s`` from ``per_token_group_quant(x, row_multiple=plan.row_multiple)``,
    ``w_q``/``w_s`` a padded block-quantized weight. ``plan`` defaults to ``plan_gemm(m)``
    (swap-AB at or below the stored M threshold)."""
    plan = plan or plan_gemm(m)
    check_gemm_operands(x_q, x_s, w_q, w_s, m, n, plan)
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    tokens = (x_q, x_s, 1, plan.token_tile, m)
    weights = (w_q, w_s, BLOCK, plan.weight_tile, n)
    left, right = (weights, tokens) if plan.swap_ab else (tokens, weights)
    (l_q, l_s, l_group, block_l, l_valid), (r_q, r_s, r_group, block_r, r_valid) = left, right
    # Swap-AB computes Y^T: it is written through Y's strides swapped.
    stride_c_l, stride_c_r = (y.stride(1), y.stride(0)) if plan.swap_ab else (y.stride(0), y.stride(1))
    grid = ((l_q.shape[0] // block_l) * (r_q.shape[0] // block_r),)
    _block_scaled_mm_kernel[grid](
        l_q, r_q, l_s, r_s, y,
        l_q.shape[0], r_q.shape[0], l_q.shape[1], l_valid, r_valid,
        l_q.stride(0), r_q.stride(0), l_s.stride(0), r_s.stride(0), stride_c_l, stride_c_r,
        L_GROUP=l_group, R_GROUP=r_group,
        BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_K=BLOCK, GROUP_L=_GROUP_L,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return y
