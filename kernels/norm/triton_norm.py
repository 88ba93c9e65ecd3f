"""Triton RMSNorm: the GPU path, the same signatures and results as ``kernels/norm/reference.py``.

Plain torch spends about seven kernels on one RMSNorm (cast, square, mean, add, rsqrt,
multiply, cast and weight) and one more on the residual add before it; at decode batch 1
those launches, not bytes, are the cost. Here each is one kernel: one program per row
holds the whole row in registers (``hidden`` up to ``MAX_HIDDEN``), sums its squares in
fp32, and writes the normalised row (and, fused, the new residual) in a single pass.

The rounding follows the reference step by step, so only the order of the fp32 sum (and the
hardware's rsqrt) can differ from it:

- the residual sum is computed in fp32 and rounded once to its dtype, as torch does for
  ``x + residual``; the norm then reads the rounded sum;
- the normalised row is rounded to the input dtype before the weight multiply, whose product
  of two 16-bit values is exact in fp32 and so rounds exactly like torch's.

The wrappers never read device memory on the host (shapes come from ``.shape``, outputs from
``torch.empty``), so they can be captured in a CUDA graph once compiled by an eager call.
Inputs may be strided; outputs are contiguous and new (nothing is written in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_wait

# The longest row one program holds in registers: 16384 covers every Llama-family width.
MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_xt, stride_xd, stride_rt, stride_rd, stride_w, stride_ot, stride_nt,
    hidden, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # kernels/pdl
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # Masked lanes read 0, which adds nothing to the sum of squares.
    x = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + cols * stride_rd, mask=mask, other=0.0)
        # One rounding of the fp32 sum to the stream's dtype, like torch's ``x + residual``;
        # the norm below must see this rounded value, as the model's next norm does.
        summed = (x + r.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nt + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.rsqrt(mean_square + eps)
    # ``x32.to(x.dtype)`` in the reference: round to the normalised tensor's dtype first.
    if ADD_RESIDUAL:
        normed = normed.to(new_residual_ptr.dtype.element_ty).to(tl.float32)
    else:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got shape {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} > {MAX_HIDDEN}: one program holds a whole row in registers")


def _num_warps(block: int) -> int:
    # About eight elements per thread (one 16-byte load of 16-bit values), 1 to 16 warps.
    return min(max(block // 256, 1), 16)


def _launch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor, new_residual: torch.Tensor, add_residual: bool,
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, new_residual,
        *x.stride(), *residual.stride(), weight.stride(0), out.stride(0), new_residual.stride(0),
        hidden, eps,
        ADD_RESIDUAL=add_residual, BLOCK=block, num_warps=_num_warps(block), **pdl_launch(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension, in fp32."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    # Without the residual add, the residual pointers are never read: pass x and out.
    _launch(x, x, weight, eps, out, out, add_residual=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's residual add followed by
    the next norm. The sum is rounded to the stream's dtype before it is normalised, exactly
    as the model's ``h = h + attn_out`` followed by ``norm(h)``. Neither input is modified."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    stream_dtype = torch.promote_types(x.dtype, residual.dtype)
    new_residual = torch.empty(x.shape, dtype=stream_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    _launch(x, residual, weight, eps, out, new_residual, add_residual=True)
    return out, new_residual
