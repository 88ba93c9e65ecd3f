"""Swap kernels: move whole KV blocks between the paged cache and host staging.

- ``reference``: torch ``gather_blocks(cache, block_ids, out)`` and
  ``scatter_blocks(src, block_ids, cache)``, the CPU path and the test oracle.
- ``triton_swap``: the same two functions as one Triton launch over all layers (imported
  on demand: it needs triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).
- ``swapper``: ``BlockSwapper``, which owns pinned staging buffers with an explicit
  lifetime and picks the fastest path per swap.

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.swap.errors import (
    BlockIdError,
    StagingStateError,
    SwapAlignmentError,
    SwapShapeError,
    SwapValidationError,
)
from kernels.swap.reference import gather_blocks, scatter_blocks
from kernels.swap.swapper import BlockSwapper, StagingBuffer

__all__ = [
    "BlockIdError",
    "BlockSwapper",
    "StagingBuffer",
    "StagingStateError",
    "SwapAlignmentError",
    "SwapShapeError",
    "SwapValidationError",
    "gather_blocks",
    "scatter_blocks",
]
