"""Torch reference for RMSNorm: the CPU path, and the oracle the Triton kernels are tested against.

The arithmetic is the model's ``RMSNorm`` (libs/model/llama.py) to the bit, which is Hugging
Face's ``LlamaRMSNorm``: normalise in fp32 whatever the input dtype, round the normalised
row back to the input dtype, then multiply by the weight (so the output dtype is
``torch.promote_types(weight.dtype, x.dtype)``).

Shapes: ``x`` and ``residual`` are ``[T, hidden]`` (``T`` may be 0), ``weight`` is ``[hidden]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension, in fp32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        # torch's fused CPU kernel: the same arithmetic, bit for bit in fp32 (tested), in one op.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's residual add followed by
    the next norm. The sum is rounded to the stream's dtype before it is normalised, exactly
    as the model's ``h = h + attn_out`` followed by ``norm(h)``. Neither input is modified."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
