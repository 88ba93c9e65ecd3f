"""Torch reference for the swap kernels: the CPU path, and the oracle the Triton kernels
are tested against. ``kernels.swap.triton_swap`` has the same signatures.

Shapes:

- ``cache``: the engine's paged cache, ``[num_blocks, layers, 2, block_size, kv_heads,
  head_dim]``, contiguous, so block ``i`` (every layer's K and V) is the chunk ``cache[i]``.
- ``block_ids``: ``n`` block ids on the host (a CPU integer tensor or a sequence of ints).
- ``out`` / ``src``: the staging buffer, ``[n, layers, 2, block_size, kv_heads, head_dim]``,
  same dtype, row ``j`` holding block ``block_ids[j]``: block-major, which is the pool's
  value payload order.

``gather_heads`` / ``scatter_heads`` move a tensor-parallel rank's heads between its
cache (``kv_heads`` = its own) and staging rows of whole blocks (kernels/swap/heads.py).

Synchronisation: both functions are stream-ordered like any torch op. On the CPU they are
done when they return; on a GPU the copies are enqueued on the current stream, and host
memory in ``out`` is only valid after that stream (or an event recorded on it) has been
synchronised. ``kernels.swap.swapper.BlockSwapper`` does that bookkeeping.
"""

from __future__ import annotations

import torch

from kernels.swap.checks import BlockIds, check_gather, check_scatter, device_ids
from kernels.swap.heads import HeadSlice, check_heads
from kernels.swap.runs import copy_if_one_run


def gather_blocks(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> None:
    """``out[j] = cache[block_ids[j]]`` for every j. Repeated ids are allowed."""
    ids = check_gather(cache, block_ids, out)
    if copy_if_one_run(cache, ids, out, out=True):
        return
    index = device_ids(ids, cache.device)
    if out.device == cache.device:
        torch.index_select(cache, 0, index, out=out)
    else:
        out.copy_(cache.index_select(0, index), non_blocking=True)


def scatter_blocks(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor) -> None:
    """``cache[block_ids[j]] = src[j]`` for every j. Ids must not repeat."""
    ids = check_scatter(src, block_ids, cache)
    if copy_if_one_run(cache, ids, src, out=False):
        return
    index = device_ids(ids, cache.device)
    cache.index_copy_(0, index, src.to(cache.device, non_blocking=True))


def gather_heads(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor, heads: HeadSlice) -> None:
    """``out[j, ..., a:b, :] = cache[block_ids[j], ..., a - first:b - first, :]`` for the
    written heads ``[a, b)`` (kernels/swap/heads.py); the rest of ``out`` is untouched."""
    ids = check_heads(cache, out, block_ids, heads, unique=False, role="out")
    a, b = heads.written
    if ids.size == 0 or a == b:
        return
    la, lb = heads.written_local
    rows = cache.index_select(0, device_ids(ids, cache.device))[..., la:lb, :]
    out[..., a:b, :].copy_(rows, non_blocking=True)


def scatter_heads(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor, heads: HeadSlice) -> None:
    """``cache[block_ids[j]] = src[j, ..., first:first + count, :]`` for every j (no repeats)."""
    ids = check_heads(cache, src, block_ids, heads, unique=True, role="src")
    if ids.size == 0:
        return
    part = src[..., heads.first : heads.first + heads.count, :]
    cache.index_copy_(0, device_ids(ids, cache.device), part.to(cache.device, non_blocking=True))
