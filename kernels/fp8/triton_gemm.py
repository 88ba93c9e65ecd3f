"""Triton block-scaled FP8 GEMM, with a swap-AB variant for few tokens: the GPU side of
``kernels/fp8/reference.py`` (``block_scaled_mm`` and ``fp8_linear``, same signatures).

``Y [M, N] = sum over K blocks b of (Xq[:, b] @ Wq[:, b]^T) * x_s[:, b] * w_s[n // 128, b]``

One kernel; a ``GemmPlan`` (kernels/fp8/plan.py) picks its tiles and which of these it does:

- normal: the tokens are the MMA's left operand (its M dimension), the weight its right;
  a program owns a ``[token_tile, weight_tile]`` tile of Y;
- swap-AB: the weight's rows are the left operand and the tokens the right: the kernel
  computes ``Y^T = W X^T`` and stores it transposed, i.e. ``(W X^T)^T``. At decode sizes
  (M of 1 to 16) the weight's rows fill the MMA's M dimension, 64 rows per warpgroup on
  Hopper, and the few tokens its N dimension (as small as 8), instead of a 64-row tile of
  which M rows are real;
- split-K: ``split_k`` programs share one output tile's K blocks. Each stores its fp32
  partial in a workspace and bumps the tile's counter; the one that finds it was last
  sums the partials in split order (so the result does not depend on which finished
  last: CUDA-graph replays and eager calls agree to the bit), writes Y and resets the
  counter for the next launch (kernels/split_counters.py);
- fused quantization (``fuse_quant``): the kernel reads the unquantized activations and
  quantizes each ``[tokens, 128]`` group in registers with the quantization kernel's own
  arithmetic (``triton_quant.quantize_groups``): one launch per linear layer instead of
  two, no padded copy. Every program re-quantizes the tokens it reads, once per K block,
  on the loop's critical path. Measured on the H200 its best plan was 1.2-1.7x slower than
  the quantization kernel plus the GEMM at M <= 16 (13.7 against 10.9 us on 4096 x 4096
  at M = 1), and after the quantizer's reciprocal (one multiplication a value) the tuned
  unfused plans with the quantization fused in are still 1.14-2.2x slower (11.8 against
  9.9 us there), so only a tuned plan that measured it faster uses it (none so far), and
  bench/fp8_tune.py's decode grid leaves it out;
- TMA (``tma``): the e4m3 operands are read through host-built tensor descriptors (Hopper's
  bulk copies, which Triton pipelines with mbarriers) instead of pointer loads.

With the swap-AB plan (small M) the GEMM and the quantization kernel before it take part in
programmatic dependent launch (kernels/pdl: every program waits for the previous kernel
before it reads or writes anything), as the bf16 decode path's kernels do. Measured in
decode, it buys 5-8% where swap-AB runs and costs the normal plan 3%
(``triton_quant.fp8_pdl_launch``; ``TIDEPOOL_PDL_FP8`` forces it on or off;
``bash bench/gpu_session.sh fp8_pdl`` measures it). Under PDL the GEMM's programs start
while the quantization kernel before it runs, so before the wait each one asks L2 for the
first 128-byte line of each of its weight rows (``_prefetch_weight``): the K loop's first
loads then find them there. Measured on the H200 (bench/RESULTS.md, issue 13) it makes
the swap-AB GEMM 1.02-1.11x faster, most on the smallest weights (4096 x 4096: 9.8 ->
8.8 us at M = 1). Prefetching more is worse: two or four lines a row gain less, and one
bulk prefetch of the whole share a row (``cp.async.bulk.prefetch.L2``) made it up to 1.6x
slower (where the resident programs' shares exceed L2 the bytes are read twice). A
prefetch into L2 is never a read a program sees: L2 is where every SM's writes meet, and
the loads that use the bytes still come after the wait, so this holds whoever wrote the
weight and when.

The K loop steps by 128, the block edge, so each step's scales are one value per row of
each operand: the MMA's fp32 partial sum of one block is scaled and added to an fp32
accumulator in registers. That is also the "promotion" DeepSeek-V3 describes: the tensor
core's FP8 accumulation (about 14 bits on Hopper) only ever sums 128 products.

Pre-quantized operands arrive padded (kernels/fp8/layout.py): rows of X to the plan's
token tile, rows of W and K to 128, so their loads need no mask; the fused path masks its
loads of X instead, and every path masks the store to the real ``[m, n]``. The checks in
layout.py run before any launch. The wrappers never read device memory on the host, so
they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8.layout import BLOCK, E4M3_MAX, FP32_MAX, SCALE_EPS, check_fused_operands, check_gemm_operands
from kernels.fp8.plan import GemmPlan, plan_gemm
from kernels.fp8.triton_quant import fp8_pdl_launch, per_token_group_quant, quantize_groups
from kernels.pdl import pdl_wait
from kernels.split_counters import split_counters


@triton.jit
def _raw_token_tile(x_ptr, offs_t, offs_t64, cols, m, k, stride_xm, stride_xk, SWAP_AB: tl.constexpr):
    """Unquantized activations of one K block, fp32, zeros past ``m`` and ``k``:
    ``[128, tokens]`` for swap-AB (the MMA's right operand), ``[tokens, 128]`` otherwise."""
    if SWAP_AB:
        inside = (offs_t[None, :] < m) & (cols[:, None] < k)
        xv = tl.load(x_ptr + offs_t64[None, :] * stride_xm + cols[:, None] * stride_xk, mask=inside, other=0.0)
    else:
        inside = (offs_t[:, None] < m) & (cols[None, :] < k)
        xv = tl.load(x_ptr + offs_t64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=inside, other=0.0)
    return xv.to(tl.float32)


@triton.jit
def _prefetch_weight(w_bytes_ptr, offs_w64, stride_w, kb_lo, kb_hi):
    """Ask L2 for the first 128-byte line of each of this program's weight rows in its share
    of K (``prefetch.global.L2``, one a row; nothing comes back to the program). Its loads
    after the PDL wait then start on lines already in L2 or on their way there."""
    if kb_hi > kb_lo:
        rows = w_bytes_ptr + offs_w64 * stride_w + kb_lo * 128
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [rows], dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit(do_not_specialize=["m", "n", "T_ROWS"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr,
    m, n, k, K_BLOCKS, T_ROWS, W_ROWS,
    stride_xm, stride_xk, stride_xs, stride_w, stride_ws, stride_ym, stride_yn,
    eps, fp32_max, fp8_max,
    w_bytes_ptr,
    SWAP_AB: tl.constexpr, X_RAW: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128
    tiles_t = tl.cdiv(T_ROWS, BLOCK_T)
    tiles_w = W_ROWS // BLOCK_W
    # Grouped ordering over (left tiles, right tiles); the left operand is the MMA's M side.
    if SWAP_AB:
        tiles_a = tiles_w
        tiles_b = tiles_t
    else:
        tiles_a = tiles_t
        tiles_b = tiles_w
    tile = tl.program_id(0)
    per_group = GROUP * tiles_b
    first_a = (tile // per_group) * GROUP
    group_size = tl.minimum(tiles_a - first_a, GROUP)
    pid_a = first_a + (tile % per_group) % group_size
    pid_b = (tile % per_group) // group_size
    if SWAP_AB:
        pid_w = pid_a
        pid_t = pid_b
    else:
        pid_t = pid_a
        pid_w = pid_b

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_t64 = offs_t.to(tl.int64)
    offs_w64 = offs_w.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    ws_ptrs = ws_ptr + (offs_w // BLOCK_K) * stride_ws
    xs_ptrs = xs_ptr + offs_t64 * stride_xs

    # This program's share of the K blocks.
    pid_k = tl.program_id(1)
    per_split = tl.cdiv(K_BLOCKS, SPLIT_K)
    kb_lo = pid_k * per_split
    kb_hi = tl.minimum(kb_lo + per_split, K_BLOCKS)

    if PDL:
        _prefetch_weight(w_bytes_ptr, offs_w64, stride_w, kb_lo, kb_hi)
    pdl_wait(PDL)  # kernels/pdl: before any read or write (triton_quant.fp8_pdl_launch: swap-AB)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.float32)
    if X_RAW:
        # Register double buffering: the next block's activations load while this block's
        # are quantized and multiplied (Triton's pipeliner only stages loads feeding a dot).
        x_next = _raw_token_tile(x_ptr, offs_t, offs_t64, kb_lo * BLOCK_K + offs_k, m, k, stride_xm, stride_xk, SWAP_AB)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        # The weight tile, [BLOCK_W, 128] as the left operand or [128, BLOCK_W] as the right.
        if USE_TMA:
            w = w_ptr.load([pid_w * BLOCK_W, k0])
            if not SWAP_AB:
                w = w.T
        elif SWAP_AB:
            w = tl.load(w_ptr + offs_w64[:, None] * stride_w + (k0 + offs_k)[None, :])
        else:
            w = tl.load(w_ptr + offs_w64[None, :] * stride_w + (k0 + offs_k)[:, None])
        w_s = tl.load(ws_ptrs + kb)
        # The token tile, [BLOCK_T, 128] as the left operand or [128, BLOCK_T] as the right.
        if X_RAW:
            xv = x_next
            # Past the last K block the columns are >= k: masked, nothing is read.
            x_next = _raw_token_tile(x_ptr, offs_t, offs_t64, k0 + BLOCK_K + offs_k, m, k, stride_xm, stride_xk, SWAP_AB)
            xq, x_s = quantize_groups(xv, 0 if SWAP_AB else 1, eps, fp32_max, fp8_max)
            xq = xq.to(tl.float8e4nv)
        else:
            if USE_TMA:
                xq = x_ptr.load([pid_t * BLOCK_T, k0])
                if SWAP_AB:
                    xq = xq.T
            elif SWAP_AB:
                xq = tl.load(x_ptr + offs_t64[None, :] * stride_xm + (k0 + offs_k)[:, None])
            else:
                xq = tl.load(x_ptr + offs_t64[:, None] * stride_xm + (k0 + offs_k)[None, :])
            x_s = tl.load(xs_ptrs + kb)
        if SWAP_AB:
            acc += tl.dot(w, xq, out_dtype=tl.float32) * w_s[:, None] * x_s[None, :]
        else:
            acc += tl.dot(xq, w, out_dtype=tl.float32) * x_s[:, None] * w_s[None, :]

    # Where each accumulator element goes in Y, and in this tile's slice of the workspace.
    if SWAP_AB:
        y_ptrs = y_ptr + offs_t64[None, :] * stride_ym + offs_w64[:, None] * stride_yn
        written = (offs_w[:, None] < n) & (offs_t[None, :] < m)
        local = tl.arange(0, BLOCK_W)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    else:
        y_ptrs = y_ptr + offs_t64[:, None] * stride_ym + offs_w64[None, :] * stride_yn
        written = (offs_t[:, None] < m) & (offs_w[None, :] < n)
        local = tl.arange(0, BLOCK_T)[:, None] * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=written)
    else:
        # Workspace [SPLIT_K, tiles, tile elements] fp32; the last program of a tile reduces.
        split_stride = tl.num_programs(0).to(tl.int64) * (BLOCK_T * BLOCK_W)
        part = part_ptr + tile.to(tl.int64) * (BLOCK_T * BLOCK_W) + local
        tl.store(part + pid_k * split_stride, acc)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.load(part, cache_modifier=".cg")  # from L2: other SMs wrote it
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(part + s * split_stride, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=written)
            tl.atomic_xchg(count_ptr + tile, 0)


def _launch(
    x: torch.Tensor, x_s: torch.Tensor | None, w_q: torch.Tensor, w_s: torch.Tensor,
    m: int, n: int, k: int, t_rows: int, out_dtype: torch.dtype, plan: GemmPlan,
) -> torch.Tensor:
    device = w_q.device
    y = torch.empty((m, n), dtype=out_dtype, device=device)
    n_pad, k_pad = w_q.shape
    tiles = triton.cdiv(t_rows, plan.token_tile) * (n_pad // plan.weight_tile)
    if plan.split_k > 1:
        part = torch.empty((plan.split_k, tiles * plan.token_tile * plan.weight_tile), dtype=torch.float32, device=device)
        counts = split_counters(device, tiles)
    else:
        part, counts = y, y  # unused
    x_arg, w_arg = x, w_q
    if plan.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [plan.token_tile, BLOCK])
        w_arg = TensorDescriptor.from_tensor(w_q, [plan.weight_tile, BLOCK])
    scales = w_s if x_s is None else x_s  # the fused path has no activation scales
    _fp8_gemm_kernel[(tiles, plan.split_k)](
        x_arg, scales, w_arg, w_s, y, part, counts,
        m, n, k, k_pad // BLOCK, t_rows, n_pad,
        x.stride(0), x.stride(1), scales.stride(0), w_q.stride(0), w_s.stride(0), y.stride(0), y.stride(1),
        SCALE_EPS, FP32_MAX, E4M3_MAX, w_q,
        SWAP_AB=plan.swap_ab, X_RAW=x_s is None, USE_TMA=plan.tma, SPLIT_K=plan.split_k,
        BLOCK_T=plan.token_tile, BLOCK_W=plan.weight_tile, GROUP=plan.group,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **fp8_pdl_launch(device, plan.swap_ab),
    )
    return y


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
    for this weight and device (swap-AB at or below the stored M threshold); its
    ``fuse_quant`` is moot: these activations are quantized already."""
    plan = plan or plan_gemm(m, n=w_q.shape[0], k=w_q.shape[1], device=w_q.device)
    check_gemm_operands(x_q, x_s, w_q, w_s, m, n, plan)
    return _launch(x_q, x_s, w_q, w_s, m, n, x_q.shape[1], x_q.shape[0], out_dtype, plan)


def fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    n: int,
    out_dtype: torch.dtype | None = None,
    plan: GemmPlan | None = None,
) -> torch.Tensor:
    """``Y [m, n] = quant(X) @ dequant(W)^T`` from unquantized ``x [m, K]``: what a linear
    layer runs. One launch when the plan fuses the quantization, else the quantization
    kernel (padding to the plan's token tile) and the GEMM."""
    m = x.shape[0]
    plan = plan or plan_gemm(m, n=w_q.shape[0], k=w_q.shape[1], device=x.device)
    out_dtype = out_dtype or x.dtype
    if plan.fuse_quant:
        check_fused_operands(x, w_q, w_s, n, plan)
        return _launch(x, None, w_q, w_s, m, n, x.shape[1], m, out_dtype, plan)
    x_q, x_s = per_token_group_quant(x, row_multiple=plan.row_multiple, swap_ab=plan.swap_ab)
    return block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=n, out_dtype=out_dtype, plan=plan)
