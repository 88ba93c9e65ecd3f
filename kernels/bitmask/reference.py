"""Torch reference of the token bitmask application (see the package docstring)."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(V/32)]`` int32 words -> ``[rows, V]`` bool (True = allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of negative words is fine: & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mask disallowed tokens of ``logits[rows[i]]`` to ``-inf`` per ``bitmask[i]``, in place.

    ``logits``: ``[N, V]`` float; ``bitmask``: ``[R, W]`` int32 with ``W * 32 >= V``;
    ``rows``: ``[R]`` int64 distinct row indices into ``logits``. Returns ``logits``.
    """
    _check(logits, bitmask, rows)
    if rows.numel() == 0:
        return logits
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
    return logits


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"expected logits [N, V], bitmask [R, W], rows [R]; got {tuple(logits.shape)}, {tuple(bitmask.shape)}, {tuple(rows.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {rows.shape[0]} logits rows")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {logits.shape[1]}")
