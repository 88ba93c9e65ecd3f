"""Triton SwiGLU activation: the GPU path behind ``kernels/activation/reference.py``.

Torch runs ``F.silu(gate) * up`` as two kernels with a round trip of the activation through
memory; here it is one. Programs form a ``[T, intermediate / BLOCK]`` grid: each reads one
block of gate columns and the matching block of up columns of one row and writes their
product, so a long row still spreads over many programs.

The arithmetic is the reference's: ``silu(g) = g / (1 + exp(-g))`` in fp32, rounded to the
input dtype (``F.silu``'s output), then multiplied by ``up`` in fp32 and rounded once more.
Only the exponential differs from torch's, by an ulp or so.

The wrapper never reads device memory on the host (shapes come from ``.shape``, the output
from ``torch.empty``), so it can be captured in a CUDA graph once compiled by an eager call.
``x`` may be strided; the output is contiguous and new.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_launch, pdl_wait

# Columns per program: wide enough for 16-byte loads on every thread of 4 warps.
_MAX_BLOCK = 1024


@triton.jit
def swiglu(gate, up, out_ty: tl.constexpr):
    """``silu(gate) * up`` of fp32 tiles, rounded as the unfused path rounds: each input to
    ``out_ty`` (a GEMM's output dtype: exact for values loaded in it), silu to ``out_ty``
    (``F.silu``'s output), then the product in fp32, rounded once more. The GEMMs that fold
    SwiGLU into their epilogue (kernels/swiglu_gemm, kernels/moe/gemm) call it on their
    accumulators, so their output equals their product followed by ``silu_and_mul``."""
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    return (act * up).to(out_ty)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_xt, stride_xd, stride_ot,
    intermediate,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # kernels/pdl
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    row_ptr = x_ptr + row * stride_xt
    gate = tl.load(row_ptr + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + (cols + intermediate) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, swiglu(gate, up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I]`` (gate columns, then up) to ``silu(gate) * up``, ``[T, I]``."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * intermediate], got shape {tuple(x.shape)}")
    num_tokens, width = x.shape
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(triton.next_power_of_2(intermediate), _MAX_BLOCK)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        x, out, *x.stride(), out.stride(0), intermediate,
        BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl_launch(x.device),
    )
    return out
