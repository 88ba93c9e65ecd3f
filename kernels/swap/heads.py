"""Head slices: a tensor-parallel rank's part of a block, in a staging buffer of whole blocks.

Under tensor parallelism a rank's paged cache holds only its KV heads,
``[num_blocks, layers, 2, block_size, count, head_dim]``, while a staging row holds the
whole block the pool stores, ``[layers, 2, block_size, total, head_dim]`` (every head).
A rank's part of a staging row is strided: for each (layer, K/V, token) row, ``count``
heads at head ``first``. ``gather_heads`` writes a cache's heads into their place in
staging rows, ``scatter_heads`` reads them back; the other heads of the row are left as
they are, so every rank of an instance can gather into the same (shared) staging row and
together they fill it.

Replicated KV heads (more ranks than KV heads) live on several ranks with the same bytes;
``written`` names the heads this cache gathers out, so each head of the block is written
by exactly one rank. A scatter reads all of the cache's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.swap.checks import BlockIds, as_block_ids, check_cache
from kernels.swap.errors import SwapAlignmentError, SwapShapeError


@dataclass(frozen=True)
class HeadSlice:
    """``first``: the block's KV head that is this cache's head 0; ``count``: the cache's
    KV heads; ``total``: a whole block's; ``written``: the block's heads ``[a, b)`` this
    cache gathers out (a subset of its own; empty for a replica)."""

    first: int
    count: int
    total: int
    written: tuple[int, int]

    def __post_init__(self) -> None:
        a, b = self.written
        if self.count < 1 or self.first < 0 or self.first + self.count > self.total:
            raise SwapShapeError(f"heads [{self.first}, {self.first + self.count}) do not fit a block of {self.total}")
        if a > b or (a < b and (a < self.first or b > self.first + self.count)):
            raise SwapShapeError(f"written heads [{a}, {b}) are not among this cache's [{self.first}, {self.first + self.count})")

    @classmethod
    def whole(cls, heads: int) -> "HeadSlice":
        return cls(0, heads, heads, (0, heads))

    @property
    def is_whole(self) -> bool:
        """Every head of the block, and written: an ordinary (TP=1) swap."""
        return self.count == self.total and self.written == (0, self.total)

    @property
    def written_local(self) -> tuple[int, int]:
        """``written`` in the cache's own head numbering."""
        return self.written[0] - self.first, self.written[1] - self.first


def check_heads(cache: torch.Tensor, staging: torch.Tensor, block_ids: BlockIds, heads: HeadSlice, *, unique: bool, role: str) -> np.ndarray:
    """Layout checks for a head-slice swap; returns the ids as int64 numpy."""
    check_cache(cache)
    if cache.shape[4] != heads.count:
        raise SwapShapeError(f"cache has {cache.shape[4]} KV heads, the head slice {heads.count}")
    ids = as_block_ids(block_ids, cache.shape[0], unique=unique)
    expected = (ids.size, *cache.shape[1:4], heads.total, cache.shape[5])
    if not isinstance(staging, torch.Tensor) or tuple(staging.shape) != expected:
        got = tuple(staging.shape) if isinstance(staging, torch.Tensor) else type(staging).__name__
        raise SwapShapeError(f"{role} must have shape {expected} ({ids.size} whole blocks), got {got}")
    if staging.dtype != cache.dtype:
        raise SwapShapeError(f"{role} dtype {staging.dtype} does not match the cache's {cache.dtype}")
    if not staging.is_contiguous():
        raise SwapAlignmentError(f"{role} must be contiguous, got strides {staging.stride()}")
    return ids
