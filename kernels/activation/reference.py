"""Torch reference for the SwiGLU activation: the CPU path, and the oracle the Triton kernel
is tested against.

``x`` is the output of the fused gate/up projection, ``[T, 2 * intermediate]`` with the gate
columns first (``T`` may be 0); the result is ``[T, intermediate]`` in ``x``'s dtype. The
arithmetic is the model's MLP (libs/model/llama.py) to the bit: ``F.silu(gate) * up``, each
rounded to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up`` are the two halves of the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
