"""Torch reference for the skinny GEMM (the oracle of ``triton_gemv``, same signature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` and ``weight`` ``[N, K]``; with
    ``silu_mul``, ``x`` is ``[M, 2K]`` (gate columns, then up) and enters as
    ``silu(gate) * up`` (kernels/activation), each rounded to ``x``'s dtype."""
    return F.linear(silu_and_mul(x) if silu_mul else x, weight, bias)
