"""float32 linear layers on the CPU through oneDNN with weights packed once, at load.

``F.linear`` on the CPU calls the BLAS torch was built with (MKL in the x86 wheels). For
the small row counts of decoding (1 row a sequence) and of speculative verification
(``k + 1`` rows) that path is slow on this project's CPUs (AMD EPYC, AVX-512): measured
with SmolLM2-135M's 30 layers of projections, 1 thread, 31 ms a step at 1 row and 46 ms
at 5 rows, where the weights' bytes alone (425 MB) stream in about 18 ms. oneDNN's
inner-product primitive over a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op that ``torch.compile``'s CPU freezing
pass emits for the same purpose) runs the same layers in 18 ms at 1 row and 20 ms at
5 rows: decoding is bound by the weight stream, as it should be, and a verify step's
extra rows cost almost nothing (bench/RESULTS.md, speculative decoding).

Same arithmetic in float32 (differences of a few ulps against MKL, as between any two
GEMMs), and row-independent: a row's result does not depend on how many rows share the
call, so a decode row and a verify chunk's first row agree bit for bit.

The packed weight is a second copy (the original stays: the embedding lookup of a tied
head, weight readers such as a pruned draft head). Only exact ``nn.Linear`` modules are
packed; quantized and FP8 layers keep their own kernels.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def available() -> bool:
    """oneDNN and the packed linear ops are in this torch build."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PackedLinear(nn.Linear):
    """``F.linear(x, weight, bias)`` with ``weight`` also held in oneDNN's blocked layout.

    Still an ``nn.Linear`` (a dense float32 layer): ``weight`` and ``bias`` are the original
    module's parameters (state dicts and weight readers are unchanged); ``packed`` is
    derived from them at construction."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)  # (nn.Linear's own would allocate a fresh weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (float32, CPU) in oneDNN's layout for ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a ``pack``ed weight; ``x`` ``[..., in]``."""
    lead = x.shape[:-1]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], "")
    return out.view(*lead, out.shape[-1])


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` with a ``PackedLinear``.
    Returns how many were packed (none where oneDNN is unavailable)."""
    if not available():
        log.info("oneDNN packed linears unavailable in this torch build: float32 CPU linears use F.linear")
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
    ]
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    return len(targets)
