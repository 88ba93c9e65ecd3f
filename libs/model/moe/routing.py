"""Routing: which experts each token goes to, and with what weight.

``select_topk`` is the router's pure op: scores from the gate's logits (softmax over all
experts, or an independent sigmoid per expert), the ``k`` best, optionally renormalised to
sum to one, exactly as each family's config says:

| family | scoring | renormalize |
|---|---|---|
| Mixtral | softmax | always |
| Qwen2-MoE, Qwen3-MoE | softmax | ``norm_topk_prob`` |

It computes in fp32 whatever the logits' dtype (as transformers does) and ranks the scores,
not the logits, so ties break as transformers' do.

``FakeBalanceExpert`` is a separate op, never part of ``select_topk``: it rewrites a
selection into a deterministic, perfectly balanced one, for load and kernel benchmarks
(real routing is skewed and varies with the prompt, which makes kernel timings noisy and
hides the balanced-load ceiling). Pair ``p = t * k + j`` goes to expert
``(offset + p) mod E``: every expert gets ``floor`` or ``ceil`` of ``T * k / E`` pairs,
a token's ``k`` experts are distinct (``k <= E``), and the router's weights are kept. The
assignment is a function of the batch's shape alone (the same batch routes the same way
every time), so a token's experts depend on its place in the step's batch, not on its
content. It changes the model's output, so it is a setting (``moe_fake_balance``) that is
never on by default, and the KV it produces is fingerprinted apart from real routing's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCORINGS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] int32 expert ids


def select_topk(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = False) -> Routing:
    """``[T, E]`` router logits to the top-``k`` experts per token and their weights."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[1]}], got {top_k}")
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids.to(torch.int32))


class FakeBalanceExpert:
    """Rewrite a selection into a balanced, deterministic one (see the module docstring).

    ``offset`` shifts the assignment, so ranks that route their own tokens (expert
    parallelism) can start where the previous rank stopped and keep the global load even."""

    def __init__(self, num_experts: int, offset: int = 0):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.offset = offset

    def __call__(self, routing: Routing) -> Routing:
        num_tokens, top_k = routing.ids.shape
        if top_k > self.num_experts:
            raise ValueError(f"top_k {top_k} > {self.num_experts} experts: a token's experts could not be distinct")
        pairs = torch.arange(num_tokens * top_k, device=routing.ids.device, dtype=torch.int64).view(num_tokens, top_k)
        ids = torch.remainder(pairs + self.offset, self.num_experts).to(torch.int32)
        return Routing(routing.weights, ids)
