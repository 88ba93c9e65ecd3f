"""Routing patterns for the MoE kernel, executor and EP tests."""

from __future__ import annotations

import torch

from libs.model.moe.routing import FakeBalanceExpert, Routing

ROUTINGS = ["uniform", "skewed", "balanced", "elsewhere"]


def make_ids(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """``[T, k]`` int32 ids, distinct per token, of the given routing pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        return FakeBalanceExpert(num_experts)(Routing(torch.zeros(num_tokens, top_k), torch.zeros(num_tokens, top_k, dtype=torch.int32))).ids
    if kind == "skewed":  # expert 0 takes every token; the rest from a steep distribution (some idle)
        p = 1.0 / torch.arange(1, num_experts, dtype=torch.float64) ** 3
        rest = torch.stack([torch.multinomial(p, top_k - 1, replacement=False, generator=g) + 1 for _ in range(num_tokens)]) if num_tokens else torch.empty(0, top_k - 1, dtype=torch.long)
        return torch.cat([torch.zeros(num_tokens, 1, dtype=torch.long), rest], 1).to(torch.int32)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]) if num_tokens else torch.empty(0, top_k, dtype=torch.long)
    if kind == "elsewhere":  # expert parallelism: pairs owned by other ranks carry ids out of range
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.4, ids + num_experts, ids)
        ids[0:1, 0] = -1 if num_tokens else ids[0:1, 0]
    return ids.to(torch.int32)


