"""Triton rotary position embedding: the GPU path behind ``kernels/rope/reference.py``.

Plain torch spends about fourteen kernels per layer on rotary (gather and cast the table
rows, then slice, negate, concatenate, multiply and add, for q and again for k). Here it is
one launch: one program per token loads the token's position and its cos/sin rows once,
then rotates all of the token's query heads and key heads, as ``[heads, head_dim / 2]``
tiles of the two halves.

**In place.** The kernel writes the rotated values over ``q`` and ``k`` and returns those
same tensors; callers read only the return values (the reference returns new tensors, so
code written against the returns works with both). Each program reads both halves of a
head before it writes either, and no two programs touch the same head, so rotating in place
is safe; ``q`` and ``k`` must not overlap each other (views of disjoint columns of one
fused qkv tensor are fine). Strided views are rotated where they lie.

**Rounding.** The reference computes in the query dtype: it casts the table rows to it,
then rounds ``x * cos``, ``rotate_half(x) * sin`` and their sum, each once. The kernel
does the same operations in fp32 and rounds to the query dtype after each of them; the
product of two 16-bit values is exact in fp32, so every rounding matches torch's and the
result is bit-identical to the reference on a GPU. fp32 inputs would lose that to fused
multiply-adds, so the kernel is compiled without them (it is memory-bound: they buy
nothing). In the CPU interpreter fp32 and fp16 are exact as well, but its casts to bf16
truncate instead of rounding, so bf16 there is within one bf16 step.

The wrapper never reads device memory on the host, so it can be captured in a CUDA graph
once compiled by an eager call. Positions are not range-checked (that would need a sync):
a position outside the tables reads out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, like_ptr):
    """``x`` rounded to ``like_ptr``'s element dtype and back to fp32: one rounding step of
    the reference, which computes in that dtype."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def rotated_halves(
    x_ptr, stride_h, stride_d, cos_lo, cos_hi, sin_lo, sin_hi,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """The ``NUM_HEADS`` heads of one token at ``x_ptr``, rotated, as ``(lo, hi)`` halves
    (``[BLOCK_H, BLOCK_HALF]`` in ``x``'s dtype, padding lanes 0); nothing is written (the
    fused decode attention rotates its query heads in registers, kernels/attention)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    lo_ptr = x_ptr + h * stride_h + d * stride_d
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = [-hi, lo], so out = [lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi],
    # each product and the sum rounded to the dtype like the reference's separate ops.
    out_lo = _round(lo * cos_lo, x_ptr) + _round(-hi * sin_lo, x_ptr)
    out_hi = _round(hi * cos_hi, x_ptr) + _round(lo * sin_hi, x_ptr)
    return out_lo.to(x_ptr.dtype.element_ty), out_hi.to(x_ptr.dtype.element_ty)


@triton.jit
def rotate_heads(
    x_ptr, stride_h, stride_d, cos_lo, cos_hi, sin_lo, sin_hi,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate the ``NUM_HEADS`` heads of one token at ``x_ptr`` in place; returns the rotated
    ``(lo, hi)`` halves as stored (``[BLOCK_H, BLOCK_HALF]``, in ``x``'s dtype) for a caller
    that also writes them elsewhere (the fused KV store, kernels/attention)."""
    out_lo, out_hi = rotated_halves(x_ptr, stride_h, stride_d, cos_lo, cos_hi, sin_lo, sin_hi, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    lo_ptr = x_ptr + h * stride_h + d * stride_d
    tl.store(lo_ptr, out_lo, mask=mask)
    tl.store(lo_ptr + HALF * stride_d, out_hi, mask=mask)
    return out_lo, out_hi


@triton.jit
def table_rows(
    positions_ptr, cos_ptr, sin_ptr, like_ptr, token,
    stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """``token``'s cos and sin rows, each half as a ``[1, BLOCK_HALF]`` tile rounded to
    ``like_ptr``'s dtype. Both halves of each row are read, as the reference uses the full
    row (in the HF layout they are equal, but nothing here relies on it); like the
    reference, the rows are cast to the query dtype before use (k shares it)."""
    pos = tl.load(positions_ptr + token * stride_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    cos_row = cos_ptr + pos * stride_cos_p
    sin_row = sin_ptr + pos * stride_sin_p
    cos_lo = _round(tl.load(cos_row + d * stride_cos_d, mask=d_mask, other=0.0), like_ptr)
    cos_hi = _round(tl.load(cos_row + (d + HALF) * stride_cos_d, mask=d_mask, other=0.0), like_ptr)
    sin_lo = _round(tl.load(sin_row + d * stride_sin_d, mask=d_mask, other=0.0), like_ptr)
    sin_hi = _round(tl.load(sin_row + (d + HALF) * stride_sin_d, mask=d_mask, other=0.0), like_ptr)
    return cos_lo, cos_hi, sin_lo, sin_hi


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # token * stride overflows int32 on long prefills
    cos_lo, cos_hi, sin_lo, sin_hi = table_rows(
        positions_ptr, cos_ptr, sin_ptr, q_ptr, token, stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
        HALF, BLOCK_HALF,
    )
    rotate_heads(q_ptr + token * stride_qt, stride_qh, stride_qd, cos_lo, cos_hi, sin_lo, sin_hi,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, stride_kd, cos_lo, cos_hi, sin_lo, sin_hi,
                  NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF)


def check_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens or head_dim")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got shape {tuple(positions.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even to rotate halves, got {head_dim}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(f"{name} must be [max_positions, {head_dim}], got shape {tuple(table.shape)}")


def rotary_num_warps(num_heads: int, half: int) -> int:
    # One warp covers a small model's token (SmolLM2: 12 heads x 32 pairs); four for wide ones.
    return 1 if triton.next_power_of_2(num_heads) * triton.next_power_of_2(half) <= 1024 else 4


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place by each token's position; returns ``(q, k)`` themselves."""
    check_rotary(q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        *q.stride(), *k.stride(), positions.stride(0), *cos.stride(), *sin.stride(),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=rotary_num_warps(num_q_heads + k.shape[1], half),
        # No fused multiply-adds: fp32 results stay bit-identical to torch's separate mul and add.
        enable_fp_fusion=False,
    )
    return q, k
