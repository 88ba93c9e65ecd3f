"""Row-wise argmax over wide rows (the sampler's greedy pick and exponential race).

- ``reference``: ``torch.argmax(x, dim=-1)``, the CPU path and the test oracle.
- ``triton_argmax``: the same in one launch that splits each row over many programs (a
  128k-vocabulary row is one of torch's reductions over a few SMs: 28 us of a 1.3 ms
  decode step on an H100); the last program of a row merges the chunks.

``argmax_op(device)`` picks one. Ties go to the first index and NaN counts as the largest
value (its first occurrence wins), both as torch does.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from kernels.argmax.reference import argmax


def argmax_op(device: torch.device | str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The Triton kernel on CUDA, the torch reference elsewhere. ``TIDEPOOL_ARGMAX=torch``
    keeps torch's on CUDA too (to compare them: the sampler runs outside the CUDA graphs,
    so the kernel's launch cost is host time)."""
    if torch.device(device).type == "cuda" and os.environ.get("TIDEPOOL_ARGMAX", "triton") != "torch":
        from kernels.argmax.triton_argmax import argmax as triton_argmax

        return triton_argmax
    return argmax


__all__ = ["argmax", "argmax_op"]
