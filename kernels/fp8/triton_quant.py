"""Triton per-token-group FP8 quantization fused with padding: the GPU side of
``kernels/fp8/reference.py::per_token_group_quant``, same signature, same bits.

One program quantizes ``BLOCK_ROWS`` tokens x one group of 128 columns: it loads them
(zeros past ``M`` and ``K``), takes each row's amax, writes the e4m3 values and the row's
scale. The grid covers the padded ``[M_pad, K_pad]`` output, so the padding the GEMM needs
(rows to its token tile, K to 128) is written by the same launch that quantizes: no
separate ``torch.zeros`` + copy, and the GEMM reads whole tiles without masks.

Bit-exactness with the torch reference:

- divisions are IEEE (``div_rn``): a plain ``/`` compiles to an approximate division on
  NVIDIA GPUs, which would move a value across a rounding boundary now and then;
- zeros are not divided: the quotient is the zero itself, and a zero dividend sends the
  GPU's IEEE division (``div.rn.f32``) down its slow path. Padding rows are all zeros, so
  at M = 1 that was half the kernel: 3.9 against 2.0 us on the H200 for K = 4096
  (bench/RESULTS.md, "The quantizer's zero dividends"), and the fused GEMMs paid it in
  every program. Only tiles that may hold padding test for zeros (``ZEROS``);
- the value is rounded to the e4m3 grid nearest-even. On the GPU that is the hardware's
  cast (``cvt.rn.satfinite``, two instructions per pair of values). Triton's CPU
  interpreter truncates the mantissa instead, without carrying into the exponent (31.2
  becomes 16), so there ``_round_to_e4m3`` rounds in fp32 first (the add-and-subtract
  1.5*2**23 trick on the value divided by its grid step), and the cast only sees
  representable values. The fp32 routine was the GPU's path too until it measured as
  the quantizer's main cost (about a dozen instructions per value); tests/gpu checks the
  hardware cast against torch's on every e4m3 value, every tie, subnormals and signs.

The wrapper never reads device memory on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8.layout import BLOCK, E4M3_MAX, FP32_MAX, FP8_DTYPE, SCALE_EPS, check_activation, padded
from kernels.pdl import pdl_launch, pdl_wait

# Programmatic dependent launch (kernels/pdl) for this kernel and kernels/fp8's GEMM, where
# the GEMM runs its swap-AB plan (small M): measured on the H200 (bench/RESULTS.md,
# "kernels/fp8's kernels in programmatic dependent launch"), FP8 decode of Llama-3.2-1B's
# shape went from 0.95 to 0.90 ms per step at batch 1 with it and from 1.14-1.17 to 1.08 at
# batch 4 and 16 (swap-AB), and from 1.555 to 1.60 at batch 64 (the normal plan). So it
# follows the plan; ``TIDEPOOL_PDL_FP8=1`` turns it on for every plan, ``0`` off.
FP8_PDL_ENV = "TIDEPOOL_PDL_FP8"

# Tokens per program: a [16, 128] tile is 8 KB of fp32, 16 bytes per thread of 4 warps.
BLOCK_ROWS = 16
# Round with the hardware's cast, except in the interpreter (read at import: tests set
# TRITON_INTERPRET before importing any kernel, as Triton itself requires).
_HW_ROUND = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _round_to_e4m3(y):
    """fp32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32.

    e4m3 has 3 mantissa bits and a smallest normal exponent of -6, so the grid step at
    ``y`` is ``2**(max(e, -6) - 3)`` with ``e`` the exponent of ``y``. ``|y| / step`` is
    below 16 and exact (a power of two), adding and subtracting 1.5 * 2**23 rounds it to
    an integer with fp32's own nearest-even rounding, and multiplying back is exact."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    a = tl.abs(y) * inv_step
    a = ((a + 12582912.0) - 12582912.0) * step
    # Put the sign back bit-wise: a tiny negative value rounds to -0.0, as torch's cast does.
    return (a.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_groups(x, AXIS: tl.constexpr, eps, fp32_max, fp8_max, ZEROS: tl.constexpr):
    """A tile of fp32 values (zeros where padding) holding whole groups of 128 along
    ``AXIS`` -> (values rounded to the e4m3 grid, in fp32; one scale per group). The one
    definition of the arithmetic: this kernel and the GEMM that fuses the quantization
    (kernels/fp8/triton_gemm.py) both call it, so their bits are the same. ``ZEROS``: the
    tile may hold padding (masked rows or columns), whose zeros then skip the division
    (module docstring); without padding that test is three instructions a value for
    nothing (the skinny GEMM measured 9.7 against 11.3 us on 4096 x 4096 at M = 1)."""
    amax = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=AXIS), eps), fp32_max)
    scale = tl.math.div_rn(amax, fp8_max)
    scales = tl.expand_dims(scale, AXIS)
    if ZEROS:
        nonzero = x != 0.0
        y = tl.where(nonzero, tl.math.div_rn(tl.where(nonzero, x, scales), scales), x)
    else:
        y = tl.math.div_rn(x, scales)
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    if _HW_ROUND:
        return y.to(tl.float8e4nv).to(tl.float32), scale
    return _round_to_e4m3(y), scale


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, M_pad,
    stride_xm, stride_xk, stride_qm, stride_sm,
    eps, fp32_max, fp8_max,
    BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr, PADDED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # kernels/pdl: before any read or write
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    rows64 = rows.to(tl.int64)  # rows * stride overflows int32 on long prefills
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=inside, other=0.0).to(tl.float32)
    if PADDED:  # some program's tile runs past M or K: that one tests for zeros
        if ((tl.program_id(0) + 1) * BLOCK_ROWS <= M) & ((group + 1) * GROUP <= K):
            y, scale = quantize_groups(x, 1, eps, fp32_max, fp8_max, False)
        else:
            y, scale = quantize_groups(x, 1, eps, fp32_max, fp8_max, True)
    else:
        y, scale = quantize_groups(x, 1, eps, fp32_max, fp8_max, False)
    written = rows < M_pad
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=written[:, None])
    tl.store(s_ptr + rows64 * stride_sm + group, scale, mask=written)


def fp8_pdl_launch(device: torch.device | str | None, swap_ab: bool) -> dict:
    """``pdl_launch``'s keyword arguments for an FP8 kernel of a GEMM with the swap-AB plan
    (``swap_ab``) or the normal one: PDL where the GPU has it and the plan is swap-AB, or
    as ``TIDEPOOL_PDL_FP8`` forces it."""
    mode = os.environ.get(FP8_PDL_ENV, "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"{FP8_PDL_ENV} must be 0, 1 or unset, got {mode!r}")
    wanted = mode == "1" or (mode == "" and swap_ab)
    return pdl_launch(device) if wanted else {"PDL": False}


def per_token_group_quant(x: torch.Tensor, *, row_multiple: int = 1, swap_ab: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [M, K]`` -> ``(q [M_pad, K_pad] e4m3, scale [M_pad, K_pad/128] fp32)``: one scale
    per token per group of 128, ``M_pad`` a multiple of ``row_multiple`` (the GEMM's token
    tile), ``K_pad`` of 128. Padding is zeros with the smallest scale. ``swap_ab``: the GEMM
    it feeds runs the swap-AB plan, so both launch in PDL (``fp8_pdl_launch``)."""
    check_activation(x, row_multiple)
    m, k = x.shape
    m_pad, k_pad = padded(m, row_multiple), padded(k)
    q = torch.empty((m_pad, k_pad), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m_pad, k_pad // BLOCK), dtype=torch.float32, device=x.device)
    if m_pad == 0 or k_pad == 0:
        return q, s
    grid = (triton.cdiv(m_pad, BLOCK_ROWS), k_pad // BLOCK)
    _per_token_group_quant_kernel[grid](
        x, q, s,
        m, k, m_pad,
        x.stride(0), x.stride(1), q.stride(0), s.stride(0),
        SCALE_EPS, FP32_MAX, E4M3_MAX,
        BLOCK_ROWS=BLOCK_ROWS, GROUP=BLOCK, PADDED=m_pad != m or m % BLOCK_ROWS != 0 or k_pad != k, num_warps=4, **fp8_pdl_launch(x.device, swap_ab),
    )
    return q, s
