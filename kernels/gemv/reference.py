"""Torch references for the skinny GEMM (the oracles of ``triton_gemv``, same signatures)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul
from kernels.fp8 import reference as fp8_ref
from kernels.norm.reference import fused_add_rms_norm, rms_norm


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_scale: torch.Tensor | None, out_features: int | None) -> torch.Tensor:
    if weight_scale is None:
        return F.linear(x, weight, bias)
    y = fp8_ref.fp8_linear(x, weight, weight_scale, n=out_features or weight.shape[0], out_dtype=torch.float32)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
    weight_scale: torch.Tensor | None = None, out_features: int | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` and ``weight`` ``[N, K]``; with
    ``silu_mul``, ``x`` is ``[M, 2K]`` (gate columns, then up) and enters as
    ``silu(gate) * up`` (kernels/activation), each rounded to ``x``'s dtype. With
    ``weight_scale``, ``weight`` is a padded e4m3 weight of kernels/fp8's format and the
    product is kernels/fp8's reference ``fp8_linear`` (the activations quantized per token
    and group of 128), its first ``out_features`` columns (default: all)."""
    return _linear(silu_and_mul(x) if silu_mul else x, weight, bias, weight_scale, out_features)


def norm_skinny_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor | None = None,
    out_features: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(x + residual), weight, bias), x + residual)``: a decoder layer's
    residual add, its next RMSNorm (kernels/norm) and the projection after it. Without
    ``residual`` (the first layer) the norm reads ``x``, which is the stream returned.
    ``weight_scale``, ``out_features``: an FP8 weight, as in ``skinny_linear``."""
    if residual is None:
        return _linear(rms_norm(x, norm_weight, eps), weight, bias, weight_scale, out_features), x
    normed, stream = fused_add_rms_norm(x, residual, norm_weight, eps)
    return _linear(normed, weight, bias, weight_scale, out_features), stream
