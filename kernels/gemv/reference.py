"""Torch references for the skinny GEMM (the oracles of ``triton_gemv``, same signatures)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul
from kernels.norm.reference import fused_add_rms_norm, rms_norm


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` and ``weight`` ``[N, K]``; with
    ``silu_mul``, ``x`` is ``[M, 2K]`` (gate columns, then up) and enters as
    ``silu(gate) * up`` (kernels/activation), each rounded to ``x``'s dtype."""
    return F.linear(silu_and_mul(x) if silu_mul else x, weight, bias)


def norm_skinny_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(x + residual), weight, bias), x + residual)``: a decoder layer's
    residual add, its next RMSNorm (kernels/norm) and the projection after it. Without
    ``residual`` (the first layer) the norm reads ``x``, which is the stream returned."""
    if residual is None:
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, stream = fused_add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), stream
