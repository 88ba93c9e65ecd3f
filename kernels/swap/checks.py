"""Input checks shared by the torch reference, the Triton path and the staging pool.

They run before anything is enqueued, so a bad call fails with a message that names the
problem instead of a device fault, silent truncation or a copy into the wrong block.
All checks read only host-side metadata: block ids are required on the host, because
range, duplicate and run checks on device ids would synchronise the device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Union

import torch

from kernels.swap.errors import BlockIdError, SwapAlignmentError, SwapShapeError

BlockIds = Union[torch.Tensor, Sequence[int]]

# The Triton kernel moves 16-byte vectors, so every block must start on a 16-byte boundary.
TRITON_ALIGNMENT = 16

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def block_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one block (all layers, K and V) of a block-major cache."""
    return math.prod(cache.shape[1:]) * cache.element_size()


def device_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ids on ``device``, without blocking the host: they go through pinned memory,
    which the caching host allocator keeps alive until the copy has read it."""
    if device.type != "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def check_cache(cache: torch.Tensor) -> None:
    """The paged cache must be ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
    and contiguous, so that block ``i`` is the one contiguous chunk ``cache[i]``."""
    if not isinstance(cache, torch.Tensor):
        raise SwapShapeError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 6:
        raise SwapShapeError(
            "cache must be 6-D [num_blocks, layers, 2, block_size, kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.shape[2] != 2:
        raise SwapShapeError(f"cache dim 2 must be 2 (K and V), got shape {tuple(cache.shape)}")
    if cache.numel() == 0:
        raise SwapShapeError(f"cache is empty: shape {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise SwapAlignmentError(
            "cache must be contiguous (block-major, one chunk per block), "
            f"got strides {cache.stride()} for shape {tuple(cache.shape)}"
        )


def as_block_ids(block_ids: BlockIds, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor, each in ``[0, num_blocks)``.

    ``unique`` is set for scatters: two sources written to one block would race in the
    kernel and leave whichever landed last.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.device.type != "cpu":
            raise BlockIdError(
                f"block ids must be a CPU tensor, got one on {block_ids.device}: they are "
                "checked and split into runs on the host, which would synchronise the device"
            )
        if block_ids.dtype not in _INTEGER_DTYPES:
            raise BlockIdError(f"block ids must be integers, got dtype {block_ids.dtype}")
        if block_ids.dim() != 1:
            raise BlockIdError(f"block ids must be 1-D, got shape {tuple(block_ids.shape)}")
        ids = block_ids.to(torch.int64)
    else:
        try:
            values = [operator.index(v) for v in block_ids]
        except TypeError as exc:
            raise BlockIdError(f"block ids must be a sequence of ints: {exc}") from None
        ids = torch.tensor(values, dtype=torch.int64)
    if ids.numel() == 0:
        return ids
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.numel():
        raise BlockIdError(
            f"block id {int(bad[0])} is out of range: the cache has {num_blocks} blocks "
            f"(valid ids 0..{num_blocks - 1})"
        )
    if unique:
        values, counts = torch.unique(ids, return_counts=True)
        repeated = values[counts > 1]
        if repeated.numel():
            raise BlockIdError(
                f"block id {int(repeated[0])} appears {int(counts[counts > 1][0])} times: "
                "a scatter must not write one block twice"
            )
    return ids


def check_staging(cache: torch.Tensor, staging: torch.Tensor, n: int, role: str) -> None:
    """``staging`` must hold exactly ``n`` blocks of the cache's layout and dtype, contiguously."""
    if not isinstance(staging, torch.Tensor):
        raise SwapShapeError(f"{role} must be a torch.Tensor, got {type(staging).__name__}")
    expected = (n, *cache.shape[1:])
    if tuple(staging.shape) != expected:
        raise SwapShapeError(
            f"{role} must have shape {expected} ({n} blocks of the cache's layout), "
            f"got {tuple(staging.shape)}"
        )
    if staging.dtype != cache.dtype:
        raise SwapShapeError(f"{role} dtype {staging.dtype} does not match the cache's {cache.dtype}")
    if not staging.is_contiguous():
        raise SwapAlignmentError(f"{role} must be contiguous, got strides {staging.stride()}")
    if staging.device != cache.device and staging.device.type != "cpu":
        raise SwapShapeError(
            f"{role} is on {staging.device}; it must be on the cache's device ({cache.device}) "
            "or in host memory"
        )


def check_triton_operands(cache: torch.Tensor, *staging: torch.Tensor) -> None:
    """What the Triton kernel needs beyond the layout checks.

    It copies 16-byte words, so a block's size and every base address must be multiples
    of 16 bytes; and it can only reach host memory that is pinned (mapped into the
    device's address space).
    """
    nbytes = block_nbytes(cache)
    if nbytes % TRITON_ALIGNMENT:
        raise SwapAlignmentError(
            f"a block is {nbytes} bytes, not a multiple of {TRITON_ALIGNMENT}: the Triton swap "
            "kernel copies 16-byte words (use kernels.swap.reference for this layout)"
        )
    for name, tensor in (("cache", cache), *(("staging", t) for t in staging)):
        if tensor.data_ptr() % TRITON_ALIGNMENT:
            raise SwapAlignmentError(
                f"{name} starts at address {tensor.data_ptr():#x}, which is not "
                f"{TRITON_ALIGNMENT}-byte aligned as the Triton swap kernel needs"
            )
        if cache.is_cuda and tensor.device.type == "cpu" and not tensor.is_pinned():
            raise SwapShapeError(
                f"{name} is in pageable host memory; the Triton kernel can only reach "
                "pinned host memory (allocate it with pin_memory=True)"
            )


def check_gather(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> torch.Tensor:
    """Checks for ``gather_blocks``; returns the ids as a CPU int64 tensor (repeats allowed)."""
    check_cache(cache)
    ids = as_block_ids(block_ids, cache.shape[0], unique=False)
    check_staging(cache, out, ids.numel(), "out")
    return ids


def check_scatter(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor) -> torch.Tensor:
    """Checks for ``scatter_blocks``; returns the ids as a CPU int64 tensor (no repeats)."""
    check_cache(cache)
    ids = as_block_ids(block_ids, cache.shape[0], unique=True)
    check_staging(cache, src, ids.numel(), "src")
    return ids
