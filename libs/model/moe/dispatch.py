"""Where a layer's experts run: all here, or sharded over an expert-parallel (EP) group.

``make_dispatch(group, num_experts)`` gives a callable ``dispatch(x, routing, run_experts)``
returning the layer's expert output for this rank's tokens; ``run_experts(x, routing)``
computes this rank's experts on rows whose ids are *local* (``0 .. num_local_experts``).

**Expert parallelism.** Rank ``r`` of a ``W``-rank group owns the global experts
``[r * E/W, (r + 1) * E/W)``. For its tokens' ``T * k`` (token, expert) pairs it:

1. sorts the pairs by owning rank (stably, so each rank's pairs keep pair order) and
   exchanges the per-rank counts (an all-to-all of ``W`` integers; the split sizes are
   then read on the host, so EP is not CUDA-graph capturable);
2. **dispatch**: all-to-all of the pairs' rows and their expert ids made local
   (``global - owner * E/W``);
3. runs its experts on what it received, each row with weight 1 (one expert per row);
4. **combine**: all-to-all of the outputs back to the pairs' ranks, unsorted, and summed
   per token with the router weights in choice order by the same combine op as EP=1.

A row that goes to two experts on one rank is sent twice (once per pair): simple and
correct; deduplicating it is an optimisation for later. A rank that receives nothing runs
its experts on an empty batch (no kernel launches) and still joins every collective.
With weight 1 the receiving side's combine is exact, so EP=W computes the very same sums
as EP=1; only a GEMM's blocking over a different batch of rows can differ in the last bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.moe.select import moe_ops_for
from libs.dist.groups import Group
from libs.model.moe.routing import Routing

RunExperts = Callable[[torch.Tensor, Routing], torch.Tensor]


class LocalDispatch:
    """Every expert on this rank: ids are already local."""

    def __init__(self, num_experts: int):
        self.num_local_experts, self.first_expert = num_experts, 0

    def __call__(self, x: torch.Tensor, routing: Routing, run_experts: RunExperts) -> torch.Tensor:
        return run_experts(x, routing)


class ExpertParallelDispatch:
    def __init__(self, group: Group, num_experts: int):
        if num_experts % group.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over an EP group of {group.size}")
        self.group = group
        self.num_local_experts = num_experts // group.size
        self.first_expert = group.rank * self.num_local_experts

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids to this rank's local ids; ``-1`` for experts owned elsewhere."""
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1).to(ids.dtype)

    def __call__(self, x: torch.Tensor, routing: Routing, run_experts: RunExperts) -> torch.Tensor:
        num_tokens, top_k = routing.ids.shape
        flat = routing.ids.reshape(-1).long()
        owner = torch.div(flat, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.group.size)
        recv_counts = self.group.exchange_counts(send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = self.group.all_to_all(x[torch.div(order, top_k, rounding_mode="floor")], send, recv)
        local_ids = self.group.all_to_all((flat - owner * self.num_local_experts)[order].to(torch.int32), send, recv)
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=x.device)
        y = run_experts(rows, Routing(ones, local_ids.view(-1, 1)))
        back = self.group.all_to_all(y, recv, send)
        pairs = torch.empty_like(back)
        pairs[order] = back
        dst = torch.arange(num_tokens * top_k, dtype=torch.int32, device=x.device).view(num_tokens, top_k)
        return moe_ops_for(x.device).combine(pairs, dst, routing.weights)


def make_dispatch(group: Group | None, num_experts: int) -> LocalDispatch | ExpertParallelDispatch:
    if group is None or group.size == 1:
        return LocalDispatch(num_experts)
    return ExpertParallelDispatch(group, num_experts)
