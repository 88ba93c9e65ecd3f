"""The flash-attention steps that decode and prefill attention share (kernels/attention's
``triton_decode`` and ``triton_prefill``): gathering a tile of keys through the block
table, and folding it into each query row's running softmax; plus the host-side checks and
tile sizes both wrappers use.

Keys are gathered token by token through the block table (``BLOCK_N`` tokens per tile,
independent of the block size), so tiles span several small blocks. All softmax arithmetic
is fp32, with base-2 exponentials and the scale folded into ``log2(e)`` (``LOG2E``). On CUDA,
16-bit inputs feed the tensor cores directly with fp32 accumulation (``native_dot``);
elsewhere (the CPU interpreter, whose bf16 arithmetic is wrong, and fp32 inputs) operands
are converted to fp32 and multiplied in IEEE fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def tile_rows(table_row_ptr, stride_bt_n, tile_start, key_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              WHOLE: tl.constexpr):
    """Keys ``[tile_start, tile_start + BLOCK_N)``: their positions, and for those below
    ``key_end`` their cache block (from the block table) and row inside it. ``WHOLE``: the
    caller knows every key of the tile is below ``key_end`` (no mask)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    if WHOLE:
        block = tl.load(table_row_ptr + (pos // BLOCK_SIZE) * stride_bt_n)
    else:
        block = tl.load(table_row_ptr + (pos // BLOCK_SIZE) * stride_bt_n, mask=pos < key_end, other=0)
    block = block.to(tl.int64)  # block * block stride overflows int32 on large caches
    return pos, block, pos % BLOCK_SIZE


@triton.jit
def gather_kv(
    k_cache_ptr, v_cache_ptr, block, row, rows_valid, kv_head,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WHOLE: tl.constexpr,
):
    """The K and V rows of ``kv_head`` at cache ``(block, row)`` where ``rows_valid``, zeros
    elsewhere. ``WHOLE``: every row is valid (and, with the head as wide as its tile,
    nothing is masked)."""
    d = tl.arange(0, BLOCK_D)
    k_ptrs = k_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_kt + kv_head * stride_kh + d[None, :] * stride_kd
    v_ptrs = v_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vt + kv_head * stride_vh + d[None, :] * stride_vd
    if WHOLE and BLOCK_D == HEAD_DIM:
        return tl.load(k_ptrs), tl.load(v_ptrs)
    kv_mask = rows_valid[:, None] & (d[None, :] < HEAD_DIM)
    return tl.load(k_ptrs, mask=kv_mask, other=0.0), tl.load(v_ptrs, mask=kv_mask, other=0.0)


@triton.jit
def fold_tile(
    q, m_i, l_i, acc, pos, k, v, key_end, q_pos, qk_scale,
    CAUSAL: tl.constexpr, NATIVE_DOT: tl.constexpr, WHOLE: tl.constexpr,
):
    """One online-softmax step: fold the loaded keys at ``pos`` below ``key_end`` into the
    running max ``m_i``, denominator ``l_i`` and output ``acc`` of every query row. With
    ``CAUSAL``, row ``r`` only sees keys at positions ``<= q_pos[r]``. ``WHOLE`` (not with
    ``CAUSAL``): every key is below ``key_end``, so nothing is masked and the scale folds
    into the exponent's argument (one FMA a score instead of a multiply, two compares and a
    select before it)."""
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    # Callers guarantee every row sees at least one key of the first tile it folds in, so
    # m_new is finite and exp2(-inf - m_new) = 0 handles both masked keys and the first step.
    if WHOLE:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0: the same max
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        key_valid = pos < key_end
        s = s * qk_scale
        if CAUSAL:
            visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = key_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attend_tile(
    q, m_i, l_i, acc,
    k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
    tile_start, key_end, q_pos, qk_scale,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, WHOLE: tl.constexpr,
):
    """``tile_rows``, ``gather_kv``, ``fold_tile``: keys ``[tile_start, tile_start + BLOCK_N) ∩ [0,
    key_end)`` folded into every query row's running softmax (``WHOLE``: the tile lies
    below ``key_end`` and is not causal-masked)."""
    pos, block, row = tile_rows(table_row_ptr, stride_bt_n, tile_start, key_end, BLOCK_N, BLOCK_SIZE, WHOLE)
    k, v = gather_kv(
        k_cache_ptr, v_cache_ptr, block, row, pos < key_end, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, WHOLE,
    )
    return fold_tile(q, m_i, l_i, acc, pos, k, v, key_end, q_pos, qk_scale, CAUSAL, NATIVE_DOT, WHOLE)



def head_block(head_dim: int) -> int:
    # tl.dot needs every tile dimension >= 16, and tl.arange a power of two.
    return max(16, triton.next_power_of_2(head_dim))


def native_dot(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Feed the tensor cores 16-bit operands directly (CUDA only: the interpreter's bf16
    arithmetic is wrong, and fp32 inputs keep IEEE fp32 products)."""
    return q.is_cuda and q.dtype == cache.dtype and q.dtype in (torch.float16, torch.bfloat16)


def check_gqa(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}")
    return num_heads // num_kv_heads

