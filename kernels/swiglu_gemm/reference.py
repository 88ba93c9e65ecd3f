"""Torch reference for the gate/up GEMM with SwiGLU folded in: the oracle the Triton kernel
is tested against, with the unfused path's arithmetic (``F.linear``, then
kernels/activation's ``silu_and_mul``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, config: object = None) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)``, ``[M, I]``, where ``weight`` is the fused
    ``[2I, K]`` gate/up projection (gate rows first). ``config`` (the Triton kernel's
    tiles) is accepted and ignored, so both take the same arguments."""
    return silu_and_mul(F.linear(x, weight))
