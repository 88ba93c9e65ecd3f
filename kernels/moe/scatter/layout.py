"""The two expert-major layouts ``ep_scatter`` produces, their capacities, and the checks.

A routed batch is ``T`` tokens, each sent to ``k`` experts (``topk_ids [T, k]``): ``T * k``
(token, choice) *pairs*. The grouped GEMMs want the pairs' rows grouped by expert:

- **contiguous** (prefill): one ``[capacity, hidden]`` buffer; expert ``e``'s rows fill a
  segment that starts on a multiple of the GEMM's M tile (``block_m``), so every tile of
  ``block_m`` rows belongs to one expert. ``m_indices[row]`` names the row's expert; rows
  that only pad a segment to the tile, and the unused tail of the buffer, are ``-1`` (the
  GEMM skips a tile whose first row is ``-1``; the combine never reads a padding row).
- **masked** (decode): ``[experts, max_m, hidden]`` plus ``counts[e]``, the number of valid
  rows of expert ``e``; rows past the count are undefined and never read.

Both come with ``dst [T, k]``: the row (flat, for masked ``e * max_m + slot``) that pair
``(t, j)`` was written to, ``-1`` for a pair whose expert id is outside ``[0, experts)``.
That is how expert parallelism marks experts living on other ranks, and how the combine
knows which pairs to add up. Within an expert, rows are in pair order (token-major), in
both implementations, so the layouts are deterministic and equal between them.

**Capacities.** Computed from shapes alone, so no device-to-host copy (and nothing that
breaks CUDA-graph capture) is needed in the common case:

- contiguous: ``T*k`` rows plus at most ``block_m - 1`` padding rows for each expert that
  can be non-empty (at most ``min(E, T*k)`` of them), rounded up to ``block_m``. This holds
  for any ids, duplicates included.
- masked: ``max_m = T``, which holds when a token's ``k`` ids are distinct (``torch.topk``
  and ``FakeBalanceExpert`` guarantee it).

A caller may pass a smaller capacity (to save memory when it knows the counts). Then the
exact need is computed from the counts on the host, and too small a buffer raises
``CapacityError`` before anything is written. The kernels also mask every store against
the capacity, so no input can make them write out of bounds (the seed PR's test allocated
too little and wrote past its buffer; here that is an error, never a write).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CapacityError(ValueError):
    """A scatter buffer is too small for the routed rows it must hold."""


class ContiguousLayout(NamedTuple):
    x: torch.Tensor  # [capacity, hidden]; padding rows undefined
    m_indices: torch.Tensor  # [capacity] int32: expert of each row, -1 for padding
    dst: torch.Tensor  # [T, k] int32: row of each pair, -1 if not routed here
    counts: torch.Tensor  # [E] int32: rows of each expert, unpadded
    seg_ends: torch.Tensor  # [E] int32: end of each expert's tile-aligned segment (cumulative)
    block_m: int


class MaskedLayout(NamedTuple):
    x: torch.Tensor  # [E, max_m, hidden]; rows past counts[e] undefined
    counts: torch.Tensor  # [E] int32: valid rows of each expert (never more than max_m)
    dst: torch.Tensor  # [T, k] int32: flat row e * max_m + slot, -1 if not routed here


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def contiguous_capacity(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Rows of a contiguous buffer that always suffice (any ids, duplicates included)."""
    pairs = num_tokens * top_k
    if pairs == 0:
        return 0
    worst = pairs + min(num_experts, pairs) * (block_m - 1)
    return cdiv(worst, block_m) * block_m


def masked_capacity(num_tokens: int) -> int:
    """``max_m`` that suffices when each token's ids are distinct (as top-k's are)."""
    return num_tokens


def check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [tokens={x.shape[0]}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.device != x.device:
        raise ValueError(f"topk_ids on {topk_ids.device}, x on {x.device}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def check_combine_inputs(y: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if y.dim() != 2:
        raise ValueError(f"y must be [rows, hidden] (a masked layout flattened), got shape {tuple(y.shape)}")
    if dst.shape != topk_weights.shape or dst.dim() != 2:
        raise ValueError(f"dst {tuple(dst.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, k]")


def check_block_m(block_m: int) -> None:
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def resolve_contiguous_capacity(
    capacity: int | None, num_tokens: int, top_k: int, num_experts: int, block_m: int, counts: torch.Tensor
) -> int:
    """The buffer's rows: the bound when ``capacity`` is None; else ``capacity``, checked.

    ``counts`` (device) are read on the host only when ``capacity`` is below the bound."""
    bound = contiguous_capacity(num_tokens, top_k, num_experts, block_m)
    if capacity is None:
        return bound
    if capacity < 0 or capacity % block_m:
        raise CapacityError(f"capacity {capacity} must be a non-negative multiple of block_m={block_m}")
    if capacity < bound:
        need = int((torch.div(counts.long() + block_m - 1, block_m, rounding_mode="floor") * block_m).sum())
        if need > capacity:
            raise CapacityError(
                f"contiguous scatter needs {need} rows ({num_tokens} tokens x top-{top_k}, each expert's "
                f"segment padded to block_m={block_m}) but capacity is {capacity}"
            )
    return capacity


def resolve_masked_capacity(max_m: int | None, num_tokens: int, counts: torch.Tensor) -> int:
    """``max_m``: the bound when None; else checked against the largest count (host read)
    when it is below the bound."""
    bound = masked_capacity(num_tokens)
    if max_m is None:
        return bound
    if max_m < 0:
        raise CapacityError(f"max_m must be >= 0, got {max_m}")
    if max_m < bound:
        need = int(counts.max()) if counts.numel() else 0
        if need > max_m:
            raise CapacityError(f"masked scatter needs max_m >= {need} (the busiest expert's rows) but max_m is {max_m}")
    return max_m
