"""Torch reference for rotary position embedding: the CPU path, and the oracle the Triton
kernel is tested against.

Shapes:

- ``q``: ``[T, num_heads, head_dim]``, ``k``: ``[T, num_kv_heads, head_dim]``, the same dtype;
  either may be a strided view (the model splits one fused qkv projection and views it).
- ``positions``: ``[T]`` integer, each token's position, in any order.
- ``cos``, ``sin``: ``[max_positions, head_dim]`` fp32 tables in the Hugging Face layout
  (``cat([freqs, freqs])``): dimension ``i`` of the first half rotates with dimension
  ``i + head_dim // 2`` of the second.

The arithmetic is the model's ``RotaryEmbedding.forward`` (libs/model/llama.py) to the bit:
the table rows are cast to the query dtype first, then ``x * cos + rotate_half(x) * sin``
in that dtype.

Contract shared with ``triton_rope``: read only the returned tensors. This reference returns
new tensors; the Triton kernel rotates ``q`` and ``k`` in place and returns them.
"""

from __future__ import annotations

import torch


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` rotated by each token's position. ``q`` and ``k`` are left unchanged."""
    return rotate(q, k, *rotary_rows(positions, cos, sin, q.dtype))


def rotary_rows(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The table rows of ``positions``, ``[T, 1, D]`` in ``dtype`` (the same for every head
    and every layer: a caller may compute them once per forward and ``rotate`` per layer)."""
    return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)


def rotate(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * c + rotate_half(x) * s`` for q and k, with rows from ``rotary_rows``."""
    return rotate_heads(q, c, s), rotate_heads(k, c, s)


def rotate_heads(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One tensor of heads ``[T, H, D]`` (q's and k's heads together, say) rotated."""
    return x * c + _rotate_half(x) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
