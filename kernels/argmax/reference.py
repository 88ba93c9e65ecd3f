"""Torch reference for the row-wise argmax (kernels/argmax)."""

from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: each row's first index of its largest value (NaN is largest)."""
    return x.argmax(dim=-1)
