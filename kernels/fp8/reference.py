"""Torch reference for the block-scaled FP8 kernels: the CPU path and the tests' oracle.

Same signatures as ``triton_quant.per_token_group_quant``, ``triton_gemm.block_scaled_mm``
and ``triton_gemm.fp8_linear``, same padded layouts and checks (kernels/fp8/layout.py).
The GEMM reference dequantizes both operands to fp32 and multiplies: that is the
definition the kernel is tested against, and (with the weight dequantized once and
cached, libs/model/fp8.py) how FP8 weights run where there are no FP8 tensor cores.

Activation quantization multiplies by the reciprocal of the scale (both IEEE divisions)
and rounds to nearest-even with saturation at +-448 (torch's cast after a clamp); the
Triton kernel does exactly the same arithmetic, so the two agree to the bit. Weights are
quantized once, at load, here only: they divide by the scale.
"""

from __future__ import annotations

import torch

from kernels.fp8.layout import (
    BLOCK,
    E4M3_MAX,
    FP32_MAX,
    FP8_DTYPE,
    SCALE_EPS,
    check_activation,
    check_fused_operands,
    check_gemm_operands,
    check_weight,
    padded,
    scales_tensor,
)
from kernels.fp8.plan import GemmPlan, plan_gemm


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` with amax kept in ``[SCALE_EPS, fp32 max]``: never 0, never inf.

    The divisor is a tensor on amax's device, not a Python number: on CUDA, torch divides
    by a CPU scalar as a multiplication by its reciprocal ("may lose one bit", says its
    source), which put the H100's reference scales one ulp off the kernel's IEEE division
    (tests/gpu's bit-exactness test failed on it). Tensor by tensor is IEEE on both."""
    return amax.float().clamp(SCALE_EPS, FP32_MAX) / torch.full((), E4M3_MAX, device=amax.device)


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to e4m3, nearest-even, saturating at +-448 (the cast alone gives NaN)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=torch.float32, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` (any float dtype) -> ``(q [N_pad, K_pad] e4m3, scale [N_pad/128, K_pad/128] fp32)``.

    Padding is zeros, so a partial block's scale is the amax of its real values (vLLM's
    partial-block scale) and an all-padding block gets the smallest scale."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {w.dtype} of shape {tuple(w.shape)}")
    n_pad, k_pad = padded(w.shape[0]), padded(w.shape[1])
    blocks = _zero_padded(w, n_pad, k_pad).view(n_pad // BLOCK, BLOCK, k_pad // BLOCK, BLOCK)
    scale = scale_of(blocks.abs().amax(dim=(1, 3)))
    q = to_e4m3(blocks / scale[:, None, :, None]).view(n_pad, k_pad)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N_pad, K_pad]``: every element times its block's scale."""
    check_weight(q, scale)
    n_pad, k_pad = q.shape
    blocks = q.float().view(n_pad // BLOCK, BLOCK, k_pad // BLOCK, BLOCK) * scale[:, None, :, None]
    return blocks.view(n_pad, k_pad)


def per_token_group_quant(
    x: torch.Tensor, *, row_multiple: int = 1, swap_ab: bool = False, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [M, K]`` -> ``(q [M_pad, K_pad] e4m3, scale [M_pad, K_pad/128] fp32)``: one scale
    per token per group of 128, ``M_pad`` a multiple of ``row_multiple`` (the GEMM's token
    tile), ``K_pad`` of 128. Padding is zeros with the smallest scale. ``swap_ab`` only
    chooses the kernel's launch (PDL); here it changes nothing. ``column_major_scales``:
    the scales are a view of a ``[K_pad/128, M_pad]`` tensor (cuBLAS's layout), same values."""
    check_activation(x, row_multiple)
    m_pad, k_pad = padded(x.shape[0], row_multiple), padded(x.shape[1])
    groups = _zero_padded(x, m_pad, k_pad).view(m_pad, k_pad // BLOCK, BLOCK)
    scale = scale_of(groups.abs().amax(dim=-1))
    inv = torch.ones_like(scale) / scale  # tensor by tensor: IEEE on CUDA too (scale_of)
    q = to_e4m3(groups * inv[..., None]).view(m_pad, k_pad)
    if column_major_scales:
        scale = scales_tensor(m_pad, k_pad, scale.device, True).copy_(scale)
    return q, scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M_pad, K_pad]``: every element times its token group's scale."""
    m_pad, k_pad = q.shape
    return (q.float().view(m_pad, k_pad // BLOCK, BLOCK) * scale[..., None]).view(m_pad, k_pad)


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
    """``Y [m, n] = dequant(X) @ dequant(W)^T``, accumulated in fp32.

    ``plan`` (default: ``plan_gemm(m)``; its ``fuse_quant`` is moot here) only decides the
    check on the activation's row padding and the operand order: swap-AB computes
    ``(W X^T)^T``, the same numbers."""
    plan = plan or plan_gemm(m)
    check_gemm_operands(x_q, x_s, w_q, w_s, m, n, plan)
    x = dequantize_activation(x_q, x_s)[:m]
    w = dequantize_weight(w_q, w_s)[:n]
    y = (w @ x.t()).t() if plan.swap_ab else x @ w.t()
    return y.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    n: int,
    out_dtype: torch.dtype | None = None,
    plan: GemmPlan | None = None,
) -> torch.Tensor:
    """``Y [m, n] = quant(X) @ dequant(W)^T`` from unquantized ``x [m, K]``: the activations
    quantized per token group (as the fused kernel does in registers), then the GEMM."""
    m = x.shape[0]
    plan = plan or plan_gemm(m)
    if plan.fuse_quant:
        check_fused_operands(x, w_q, w_s, n, plan)
    x_q, x_s = per_token_group_quant(x, row_multiple=plan.row_multiple)
    return block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=n, out_dtype=out_dtype or x.dtype, plan=plan)
