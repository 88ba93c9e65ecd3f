"""The sparse MoE block that replaces a decoder layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

    logits = gate(x)                                  [T, E]
    routing = select_topk(logits)                     the k experts of each token, weights
    routing = FakeBalanceExpert(routing)              only with moe_fake_balance (benchmarks)
    out = experts(x, routing)                         here, or over the EP group (dispatch.py)
    out += sigmoid(shared_gate(x)) * shared(x)        Qwen2-MoE's shared expert

Experts are stored stacked and fused: ``w13 [E, 2I, H]`` (each expert's gate rows, then
its up rows, like the dense MLP's ``gate_up_proj``) and ``w2 [E, H, I]``, so one grouped
GEMM covers every expert. Under expert parallelism only this rank's experts are stored.
With FP8 (``--quantization fp8``) ``w13`` and ``w2`` are ``Fp8Experts`` (libs/model/fp8.py)
in place of the parameters: quantized at load (``quantize_experts``) or read as they are
from an FP8 checkpoint; the router stays in the model's dtype, and the shared expert is a
dense MLP like any other (Fp8Linear under fp8; llama.py loads it).

The executor is chosen at the first forward, when the device and dtype are known
(libs/model/moe/strategy.py), and logged with the reason.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from libs.model.config import ModelConfig
from libs.model.fp8 import Fp8Experts, Fp8Weight
from libs.model.graph_capture import capturing_graph
from libs.model.moe.dispatch import make_dispatch
from libs.model.moe.options import MoEOptions
from libs.model.moe.routing import FakeBalanceExpert, Routing, select_topk
from libs.model.moe.strategy import LayerShape, Selection, select_executor

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
            self.selection = select_executor(self.strategy, x.device, x.dtype, shape, fp8=self.fp8)
            log.info("MoE experts %s: %s", shape.key(), self.selection.reason)
        capturing = capturing_graph(x.device)
        executor = self.selection.executor.for_tokens(x.shape[0], capturing)
        if not executor.graph_safe and capturing:
            raise RuntimeError(
                f"the MoE executor {executor.name!r} (moe_strategy={self.strategy!r}) cannot be captured in a CUDA "
                "graph; use moe_strategy auto, hybrid, contiguous or masked, or turn CUDA graphs off"
            )
        return executor(x, routing, self.w13, self.w2)

    @property
    def fp8(self) -> bool:
        return isinstance(self.w13, Fp8Experts)

    def set_experts(self, w13: Fp8Experts, w2: Fp8Experts) -> None:
        """Run the experts in FP8: ``w13``/``w2`` replace the dense parameters."""
        for name, new in (("w13", w13), ("w2", w2)):
            old = getattr(self, name)
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"FP8 experts {name} of shape {list(new.shape)} != the layer's {list(old.shape)}")
            delattr(self, name)
            setattr(self, name, new)
        self.selection = None  # the executor depends on the weights' format

    @torch.no_grad()
    def quantize_experts(self, device: torch.device) -> int:
        """Quantize the dense experts to FP8 on ``device`` (1), or leave FP8 ones alone (0)."""
        if self.fp8:
            return 0
        self.set_experts(Fp8Experts.quantize(self.w13.detach(), parts=2, device=device), Fp8Experts.quantize(self.w2.detach(), device=device))
        return 1

    @torch.no_grad()
    def load_hf_state(self, take: Callable[[str], torch.Tensor], layer_prefix: str) -> None:
        """Copy this block's router and experts from a Hugging Face state dict (``take(name)``
        marks a name used; the shared expert is a dense MLP, which llama.py loads). Every
        expert is taken, so none looks unused, but only local ones are kept. Experts that
        all arrive as ``Fp8Weight`` (an FP8 checkpoint's) are kept in FP8 as they are."""
        block, (gate_name, up_name, down_name) = _HF_NAMES[self.architecture]
        p = f"{layer_prefix}{block}."
        _copy(self.gate.weight, _dense(take(p + "gate.weight")), p + "gate.weight")
        first, local = self.dispatch.first_expert, self.dispatch.num_local_experts
        w13: list[list] = []
        w2: list[list] = []
        for e in range(self.num_experts):
            q = f"{p}experts.{e}."
            gate, up, down = (take(q + n + ".weight") for n in (gate_name, up_name, down_name))
            if first <= e < first + local:
                w13.append([gate, up])
                w2.append([down])
        if all(isinstance(part, Fp8Weight) for parts in w13 + w2 for part in parts):
            self.set_experts(Fp8Experts.stack(w13), Fp8Experts.stack(w2))
            return
        for i, ((gate, up), (down,)) in enumerate(zip(w13, w2)):
            q = f"{p}experts.{first + i}."
            _copy(self.w13[i], torch.cat([_dense(gate), _dense(up)]), q + f"{{{gate_name},{up_name}}}.weight")
            _copy(self.w2[i], _dense(down), q + down_name + ".weight")


def _dense(value: torch.Tensor | Fp8Weight) -> torch.Tensor:
    return value.dequantize() if isinstance(value, Fp8Weight) else value


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
    param.copy_(value)
