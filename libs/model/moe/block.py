"""The sparse MoE block that replaces a decoder layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

    logits = gate(x)                                  [T, E]
    routing = select_topk(logits)                     the k experts of each token, weights
    routing = FakeBalanceExpert(routing)              only with moe_fake_balance (benchmarks)
    out = experts(x, routing)                         here, or over the EP group (dispatch.py)
    out += sigmoid(shared_gate(x)) * shared(x)        Qwen2-MoE's shared expert

Experts are stored stacked and fused: ``w13 [E, 2I, H]`` (each expert's gate rows, then
its up rows, like the dense MLP's ``gate_up_proj``) and ``w2 [E, H, I]``, so one grouped
GEMM covers every expert. Under expert parallelism only this rank's experts are stored.

The executor is chosen at the first forward, when the device and dtype are known
(libs/model/moe/strategy.py), and logged with the reason.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from libs.model.config import ModelConfig
from libs.model.moe.dispatch import make_dispatch
from libs.model.moe.options import MoEOptions
from libs.model.moe.routing import FakeBalanceExpert, Routing, select_topk
from libs.model.moe.strategy import LayerShape, Selection, capturing_graph, select_executor

log = logging.getLogger(__name__)

# Checkpoint names, per family: the block's module name and each expert's (gate, up, down).
_HF_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, options: MoEOptions, shared_expert: nn.Module | None = None):
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture} has no MoE config")
        self.architecture = cfg.architecture
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.scoring, self.renormalize = moe.scoring, moe.renormalize
        self.strategy = options.strategy
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.dispatch = make_dispatch(options.ep, moe.num_experts)
        local = self.dispatch.num_local_experts
        self.w13 = nn.Parameter(torch.empty(local, 2 * moe.intermediate_size, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, cfg.hidden_size, moe.intermediate_size))
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared_expert is not None else None
        # Under EP each rank starts on its own experts: equal runs, evenly spaced, keep the
        # global load balanced too (within one pair per expert for equal batches).
        self.fake_balance = FakeBalanceExpert(moe.num_experts, offset=self.dispatch.first_expert) if options.fake_balance else None
        self.selection: Selection | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = select_topk(self.gate(x), self.top_k, scoring=self.scoring, renormalize=self.renormalize)
        if self.fake_balance is not None:
            routing = self.fake_balance(routing)
        out = self.dispatch(x, routing, self.run_experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def run_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's experts on rows routed to them (``routing.ids`` are local ids)."""
        if self.selection is None:
            shape = LayerShape(self.w13.shape[0], routing.ids.shape[1], self.w13.shape[2], self.w2.shape[2])
            self.selection = select_executor(self.strategy, x.device, x.dtype, shape)
            log.info("MoE experts %s: %s", shape.key(), self.selection.reason)
        executor = self.selection.executor.for_tokens(x.shape[0])
        if not executor.graph_safe and capturing_graph(x.device):
            raise RuntimeError(
                f"the MoE executor {executor.name!r} (moe_strategy={self.strategy!r}) cannot be captured in a CUDA "
                "graph; use moe_strategy auto, hybrid, contiguous or masked, or turn CUDA graphs off"
            )
        return executor(x, routing, self.w13, self.w2)

    @torch.no_grad()
    def load_hf_state(self, take: Callable[[str], torch.Tensor], layer_prefix: str) -> None:
        """Copy this block's weights from a Hugging Face state dict (``take(name)`` marks a
        name used). Every expert is taken, so none looks unused, but only local ones are kept."""
        block, (gate_name, up_name, down_name) = _HF_NAMES[self.architecture]
        p = f"{layer_prefix}{block}."
        _copy(self.gate.weight, take(p + "gate.weight"), p + "gate.weight")
        first, local = self.dispatch.first_expert, self.dispatch.num_local_experts
        for e in range(self.num_experts):
            q = f"{p}experts.{e}."
            gate, up, down = (take(q + n + ".weight") for n in (gate_name, up_name, down_name))
            if first <= e < first + local:
                _copy(self.w13[e - first], torch.cat([gate, up]), q + f"{{{gate_name},{up_name}}}.weight")
                _copy(self.w2[e - first], down, q + down_name + ".weight")
        if self.shared_expert is not None:
            s = p + "shared_expert."
            _copy(self.shared_expert.gate_up_proj.weight, torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")]), s + "{gate,up}_proj.weight")
            _copy(self.shared_expert.down_proj.weight, take(s + "down_proj.weight"), s + "down_proj.weight")
            _copy(self.shared_expert_gate.weight, take(p + "shared_expert_gate.weight"), p + "shared_expert_gate.weight")


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    param.copy_(value)
