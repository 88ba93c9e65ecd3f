"""Input checks shared by the torch reference, the Triton path and the staging pool.

They run before anything is enqueued, so a bad call fails with a message that names the
problem instead of a device fault, silent truncation or a copy into the wrong block.
All checks read only host-side metadata: block ids are required on the host, because
range, duplicate and run checks on device ids would synchronise the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from kernels.swap.errors import BlockIdError, SwapAlignmentError, SwapShapeError

BlockIds = Union[torch.Tensor, np.ndarray, Sequence[int]]

# The Triton kernel moves 16-byte vectors, so every block must start on a 16-byte boundary.
TRITON_ALIGNMENT = 16


def block_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one block (all layers, K and V) of a block-major cache."""
    return math.prod(cache.shape[1:]) * cache.element_size()


def device_ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Checked host ids as an int64 tensor on ``device``, without blocking the host: they
    go through pinned memory, which the caching host allocator keeps alive until the copy
    has read it."""
    ids_cpu = torch.from_numpy(ids)
    if device.type != "cuda":
        return ids_cpu
    return ids_cpu.pin_memory().to(device, non_blocking=True)


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


def as_block_ids(block_ids: BlockIds, num_blocks: int, *, unique: bool) -> np.ndarray:
    """Block ids as a 1-D int64 numpy array, each in ``[0, num_blocks)``.

    numpy, not torch: for a few hundred ids each torch op costs several microseconds of
    host time, and that time sits in front of every swap. ``unique`` is set for scatters:
    two sources written to one block would race in the kernel, the last one winning.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.device.type != "cpu":
            raise BlockIdError(
                f"block ids must be a CPU tensor, got one on {block_ids.device}: they are "
                "checked and split into runs on the host, which would synchronise the device"
            )
        if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
            raise BlockIdError(f"block ids must be integers, got dtype {block_ids.dtype}")
        block_ids = block_ids.numpy()
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise BlockIdError(f"block ids must be 1-D, got shape {ids.shape}")
    if ids.size == 0:
        return np.empty(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise BlockIdError(f"block ids must be integers, got {ids.dtype} ({ids[:4].tolist()}...)")
    ids = ids.astype(np.int64, copy=False)
    if ids.min() < 0 or ids.max() >= num_blocks:
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise BlockIdError(
            f"block id {bad} is out of range: the cache has {num_blocks} blocks "
            f"(valid ids 0..{num_blocks - 1})"
        )
    if unique:
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            raise BlockIdError(
                f"block id {repeated[0]} appears {int(np.count_nonzero(ids == repeated[0]))} "
                "times: a scatter must not write one block twice"
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


def check_gather(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> np.ndarray:
    """Checks for ``gather_blocks``; returns the ids as int64 numpy (repeats allowed)."""
    check_cache(cache)
    ids = as_block_ids(block_ids, cache.shape[0], unique=False)
    check_staging(cache, out, ids.size, "out")
    return ids


def check_scatter(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor) -> np.ndarray:
    """Checks for ``scatter_blocks``; returns the ids as int64 numpy (no repeats)."""
    check_cache(cache)
    ids = as_block_ids(block_ids, cache.shape[0], unique=True)
    check_staging(cache, src, ids.size, "src")
    return ids
