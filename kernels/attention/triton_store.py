"""Triton KV store: this step's K and V rows into their cache slots (``store_kv``), and the
same with kernels/rope's rotary on q and k first, in one launch (``rotary_store_kv``, the
model's path on CUDA: one launch per layer instead of two). Same signatures and
semantics as ``kernels/attention/reference.py``.

One program per token copies its ``[kv_heads, head_dim]`` K and V rows into their slots. A
negative slot is padding and writes nothing. ``store_rotated_kv`` is the one copy of the
rotated store, which decode attention's fused form (``triton_decode``) calls too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rope.triton_rope import check_rotary, rotary_num_warps, rotate_heads, table_rows


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding (e.g. CUDA-graph batch padding)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                    mask=mask)
        k_dst = (k_cache_ptr + block * stride_kcb + offset * stride_kcs
                 + h[:, None] * stride_kch + d[None, :] * stride_kcd)
        v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs
                 + h[:, None] * stride_vch + d[None, :] * stride_vcd)
        # Through fp32: a plain copy when dtypes match, a rounding cast when they do not.
        tl.store(k_dst, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_rotated_kv(
    k_lo, k_hi, v_src, stride_vh, stride_vd, slot, h, d, mask,
    k_cache_ptr, v_cache_ptr,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One token's rotated K halves (heads ``h``, ``[heads, half]`` tiles) and its V (read
    at ``v_src``) into cache slot ``slot`` (>= 0)."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    tl.store(k_dst, k_lo.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF * stride_kcd, k_hi.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_src = v_src + h * stride_vh + d * stride_vd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    v_lo = tl.load(v_src, mask=mask)
    v_hi = tl.load(v_src + HALF * stride_vd, mask=mask)
    tl.store(v_dst, v_lo.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF * stride_vcd, v_hi.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One token: rotary on its q and k heads (in place, kernels/rope's arithmetic), then its
    rotated K and its V into the token's cache slot (a negative slot writes nothing)."""
    token = tl.program_id(0).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = table_rows(
        positions_ptr, cos_ptr, sin_ptr, q_ptr, token, stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
        HALF, BLOCK_HALF,
    )
    rotate_heads(q_ptr + token * stride_qt, stride_qh, stride_qd, cos_lo, cos_hi, sin_lo, sin_hi,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    k_lo, k_hi = rotate_heads(k_ptr + token * stride_kt, stride_kh, stride_kd, cos_lo, cos_hi, sin_lo, sin_hi,
                               NUM_KV_HEADS, HALF, BLOCK_HK, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_HK)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        store_rotated_kv(
            k_lo, k_hi, v_ptr + token * stride_vt, stride_vh, stride_vd, slot, h, d, (h < NUM_KV_HEADS) & (d < HALF),
            k_cache_ptr, v_cache_ptr, stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
            HALF, BLOCK_SIZE,
        )



def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K and V (``[T, kv_heads, head_dim]``) into their cache slots.
    Slots ``< 0`` are padding and write nothing."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` then ``store_kv`` in one launch: rotates ``q`` and ``k`` in place
    (``[T, heads, head_dim]``; returns them, kernels/rope's contract) and writes the rotated
    K and V into their cache slots. Saves a launch per layer and a re-read of K."""
    check_rotary(q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    num_kv_heads, half = k.shape[1], head_dim // 2
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        *q.stride(), *k.stride(), *v.stride(), positions.stride(0), *cos.stride(), *sin.stride(),
        *k_cache.stride(), *v_cache.stride(),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=rotary_num_warps(num_q_heads + num_kv_heads, half),
        enable_fp_fusion=False,  # bit-identical to apply_rotary (kernels/rope/triton_rope.py)
    )
    return q, k

