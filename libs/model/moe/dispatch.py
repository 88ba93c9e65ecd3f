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

from typing import Callable, NamedTuple

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

    def dispatch(self, x: torch.Tensor, routing: Routing) -> "Dispatched":
        """Steps 1-2: this rank's pairs to their experts' ranks; what the others send here."""
        num_tokens, top_k = routing.ids.shape
        flat = routing.ids.reshape(-1).long()
        owner = torch.div(flat, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.group.size)
        send, recv = send_counts.tolist(), self.group.exchange_counts(send_counts).tolist()
        rows = self.group.all_to_all(x[torch.div(order, top_k, rounding_mode="floor")], send, recv)
        local_ids = self.group.all_to_all((flat - owner * self.num_local_experts)[order].to(torch.int32), send, recv)
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=x.device)
        return Dispatched(rows, Routing(ones, local_ids.view(-1, 1)), order, send, recv, num_tokens, top_k)

    def combine(self, y: torch.Tensor, d: "Dispatched", weights: torch.Tensor) -> torch.Tensor:
        """Step 4: the experts' outputs back to their pairs, summed per token with ``weights``."""
        back = self.group.all_to_all(y, d.recv, d.send)
        pairs = torch.empty_like(back)
        pairs[d.order] = back
        dst = torch.arange(d.num_tokens * d.top_k, dtype=torch.int32, device=y.device).view(d.num_tokens, d.top_k)
        return moe_ops_for(y.device).combine(pairs, dst, weights)

    def __call__(self, x: torch.Tensor, routing: Routing, run_experts: RunExperts) -> torch.Tensor:
        d = self.dispatch(x, routing)
        return self.combine(run_experts(d.rows, d.routing), d, routing.weights)


class Dispatched(NamedTuple):
    """What a rank received (``rows`` with their local ``routing``), and how to send back."""

    rows: torch.Tensor
    routing: Routing
    order: torch.Tensor  # this rank's pairs, sorted by owning rank
    send: list[int]  # pairs sent to each member
    recv: list[int]  # rows received from each member
    num_tokens: int
    top_k: int


def make_dispatch(group: Group | None, num_experts: int) -> LocalDispatch | ExpertParallelDispatch:
    if group is None or group.size == 1:
        return LocalDispatch(num_experts)
    return ExpertParallelDispatch(group, num_experts)
