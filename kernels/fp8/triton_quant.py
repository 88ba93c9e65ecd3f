"""Triton per-token-group FP8 quantization fused with padding: the GPU side of
``kernels/fp8/reference.py::per_token_group_quant``, same signature, same bits.

One program quantizes ``BLOCK_ROWS`` tokens x one group of 128 columns: it loads them
(zeros past ``M`` and ``K``), takes each row's amax, writes the e4m3 values and the row's
scale. The grid covers the padded ``[M_pad, K_pad]`` output, so the padding the GEMM needs
(rows to its token tile, K to 128) is written by the same launch that quantizes: no
separate ``torch.zeros`` + copy, and the GEMM reads whole tiles without masks.

Bit-exactness with the torch reference:

- each group's scale and its reciprocal are IEEE divisions (``div_rn``: a plain ``/``
  compiles to an approximate division on NVIDIA GPUs, which would move a value across a
  rounding boundary now and then); the values are then multiplied by the reciprocal, as
  the reference does. Dividing every value by its scale instead (``div.rn.f32``: a
  reciprocal, Newton steps and a check, with a slow path that zero dividends took) made
  616 SASS instructions of a [16, 128] program against 424 now; on the H200 the kernel
  went from 17.3 to 15.3 us at M = 4096, K = 4096 (a copy of the same bytes: 13.9 us) and
  from 2.0 to 1.5 us at M = 1 (bench/RESULTS.md, "The quantizer multiplies by the
  reciprocal"). The two forms differ on about one bf16 activation in 2,000;
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

from kernels.fp8.layout import BLOCK, E4M3_MAX, FP32_MAX, FP8_DTYPE, SCALE_EPS, check_activation, padded, scales_tensor
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
def quantize_groups(x, AXIS: tl.constexpr, eps, fp32_max, fp8_max):
    """A tile of fp32 values (zeros where padding) holding whole groups of 128 along
    ``AXIS`` -> (values rounded to the e4m3 grid, in fp32; one scale per group). The one
    definition of the arithmetic: this kernel and the GEMMs that fuse the quantization
    (kernels/fp8/triton_gemm.py, kernels/gemv, kernels/moe/gemm) all call it, so their
    bits are the same. Two IEEE divisions per group, one multiplication per value."""
    amax = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=AXIS), eps), fp32_max)
    scale = tl.math.div_rn(amax, fp8_max)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    y = x * tl.expand_dims(inv, AXIS)
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    if _HW_ROUND:
        return y.to(tl.float8e4nv).to(tl.float32), scale
    return _round_to_e4m3(y), scale


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, M_pad,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sg,
    eps, fp32_max, fp8_max,
    BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # kernels/pdl: before any read or write
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    rows64 = rows.to(tl.int64)  # rows * stride overflows int32 on long prefills
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=inside, other=0.0).to(tl.float32)
    y, scale = quantize_groups(x, 1, eps, fp32_max, fp8_max)
    written = rows < M_pad
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=written[:, None])
    tl.store(s_ptr + rows64 * stride_sm + group * stride_sg, scale, mask=written)


def fp8_pdl_launch(device: torch.device | str | None, swap_ab: bool) -> dict:
    """``pdl_launch``'s keyword arguments for an FP8 kernel of a GEMM with the swap-AB plan
    (``swap_ab``) or the normal one: PDL where the GPU has it and the plan is swap-AB, or
    as ``TIDEPOOL_PDL_FP8`` forces it."""
    mode = os.environ.get(FP8_PDL_ENV, "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"{FP8_PDL_ENV} must be 0, 1 or unset, got {mode!r}")
    wanted = mode == "1" or (mode == "" and swap_ab)
    return pdl_launch(device) if wanted else {"PDL": False}


def per_token_group_quant(
    x: torch.Tensor, *, row_multiple: int = 1, swap_ab: bool = False, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [M, K]`` -> ``(q [M_pad, K_pad] e4m3, scale [M_pad, K_pad/128] fp32)``: one scale
    per token per group of 128, ``M_pad`` a multiple of ``row_multiple`` (the GEMM's token
    tile), ``K_pad`` of 128. Padding is zeros with the smallest scale. ``swap_ab``: the GEMM
    it feeds runs the swap-AB plan, so both launch in PDL (``fp8_pdl_launch``).
    ``column_major_scales``: the scales are a view of a ``[K_pad/128, M_pad]`` tensor, the
    layout cuBLAS's block-scaled GEMM reads (kernels/fp8/cublas_gemm.py), written so by this
    launch instead of a transposing copy after it."""
    check_activation(x, row_multiple)
    m, k = x.shape
    m_pad, k_pad = padded(m, row_multiple), padded(k)
    q = torch.empty((m_pad, k_pad), dtype=FP8_DTYPE, device=x.device)
    s = scales_tensor(m_pad, k_pad, x.device, column_major_scales)
    if m_pad == 0 or k_pad == 0:
        return q, s
    grid = (triton.cdiv(m_pad, BLOCK_ROWS), k_pad // BLOCK)
    _per_token_group_quant_kernel[grid](
        x, q, s,
        m, k, m_pad,
        x.stride(0), x.stride(1), q.stride(0), *s.stride(),
        SCALE_EPS, FP32_MAX, E4M3_MAX,
        BLOCK_ROWS=BLOCK_ROWS, GROUP=BLOCK, num_warps=4, **fp8_pdl_launch(x.device, swap_ab),
    )
    return q, s
