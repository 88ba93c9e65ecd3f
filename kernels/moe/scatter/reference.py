"""Torch reference of ep_scatter and the combine: the CPU path and the Triton kernels' oracle.

- ``scatter_contiguous(x, topk_ids, num_experts, block_m, capacity=None) -> ContiguousLayout``
- ``scatter_masked(x, topk_ids, num_experts, max_m=None) -> MaskedLayout``
- ``combine(y, dst, topk_weights) -> out [T, hidden]``: ``out[t] = sum_j w[t, j] * y[dst[t, j]]``
  over the pairs with ``dst >= 0``, accumulated in fp32 in choice order ``j = 0..k-1`` and
  rounded once to ``y``'s dtype.

Layouts, capacities and their checks are described in ``kernels/moe/scatter/layout.py``.
An empty batch (``T == 0``) returns empty layouts and a ``[0, hidden]`` output.
"""

from __future__ import annotations

import torch

from kernels.moe.scatter.layout import (
    ContiguousLayout,
    MaskedLayout,
    check_block_m,
    check_combine_inputs,
    check_inputs,
    resolve_contiguous_capacity,
    resolve_masked_capacity,
)


def _ranks(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert, rank, counts)`` of every pair, flat: ``expert`` is the id or ``num_experts``
    for a pair routed elsewhere; ``rank`` its position among its expert's pairs, in pair order."""
    flat = topk_ids.reshape(-1).long()
    expert = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(expert, stable=True)
    all_counts = torch.bincount(expert, minlength=num_experts + 1)
    starts = torch.cumsum(all_counts, 0) - all_counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[expert[order]]
    return expert, rank, all_counts[:num_experts].to(torch.int32)


def scatter_contiguous(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_m: int, capacity: int | None = None
) -> ContiguousLayout:
    check_inputs(x, topk_ids, num_experts)
    check_block_m(block_m)
    num_tokens, top_k = topk_ids.shape
    expert, rank, counts = _ranks(topk_ids, num_experts)
    capacity = resolve_contiguous_capacity(capacity, num_tokens, top_k, num_experts, block_m, counts)
    aligned = (counts.long() + block_m - 1) // block_m * block_m
    seg_ends = torch.cumsum(aligned, 0)
    seg_starts = torch.cat([seg_ends.new_zeros(1), seg_ends[:-1]])
    valid = expert < num_experts
    dst = torch.where(valid, seg_starts[expert.clamp(max=num_experts - 1)] + rank, -1)
    out = torch.empty((capacity, x.shape[1]), dtype=x.dtype, device=x.device)
    rows = dst[valid]
    out[rows] = x[torch.div(torch.nonzero(valid).squeeze(1), top_k, rounding_mode="floor")]
    m_indices = torch.full((capacity,), -1, dtype=torch.int32, device=x.device)
    m_indices[rows] = expert[valid].to(torch.int32)
    return ContiguousLayout(out, m_indices, dst.view(num_tokens, top_k).to(torch.int32), counts, seg_ends.to(torch.int32), block_m)


def scatter_masked(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_m: int | None = None) -> MaskedLayout:
    check_inputs(x, topk_ids, num_experts)
    num_tokens, top_k = topk_ids.shape
    expert, rank, counts = _ranks(topk_ids, num_experts)
    max_m = resolve_masked_capacity(max_m, num_tokens, counts)
    valid = (expert < num_experts) & (rank < max_m)  # rank >= max_m only with repeated ids
    dst = torch.where(valid, expert * max_m + rank, -1)
    out = torch.empty((num_experts, max_m, x.shape[1]), dtype=x.dtype, device=x.device)
    rows = dst[valid]
    out.view(-1, x.shape[1])[rows] = x[torch.div(torch.nonzero(valid).squeeze(1), top_k, rounding_mode="floor")]
    return MaskedLayout(out, counts.clamp(max=max_m), dst.view(num_tokens, top_k).to(torch.int32))


def combine(y: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    check_combine_inputs(y, dst, topk_weights)
    num_tokens, top_k = dst.shape
    acc = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    if num_tokens == 0 or y.shape[0] == 0:  # nothing to gather (every pair routed elsewhere)
        return acc.to(y.dtype)
    valid = dst >= 0
    rows = y[dst.clamp(min=0).long()].float()  # [T, k, hidden]; rows of dropped pairs unused
    w = topk_weights.float()
    for j in range(top_k):
        # where, not a multiply by the mask: a padding row may hold NaN, and NaN * 0 is NaN
        acc += torch.where(valid[:, j, None], w[:, j, None] * rows[:, j], 0.0)
    return acc.to(y.dtype)
