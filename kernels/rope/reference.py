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
    c = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]: the same rotation for every head
    s = sin[positions].to(q.dtype).unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
