"""Expert executors: routed tokens in, the weighted sum of their experts' outputs out.

Every executor computes, for each token ``t``, ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])``
with ``expert_e(x) = w2[e] @ silu_and_mul(w13[e] @ x)`` (SwiGLU; ``w13 [E, 2I, H]`` is the
fused gate/up weight, ``w2 [E, H, I]`` the down weight), summing the ``k`` terms in fp32 in
choice order. Ids outside ``[0, E)`` are experts that live elsewhere (expert parallelism)
and contribute nothing. They differ in how the rows reach the GEMMs:

- ``LoopExecutor``: a loop of torch matmuls over the experts that got tokens. The CPU path,
  the reference the others are tested against, and the benchmark's per-expert peer.
  Reads the busy experts on the host, so it cannot be captured in a CUDA graph.
- ``ContiguousExecutor``: ep_scatter into tile-aligned segments, two contiguous grouped
  GEMMs (SwiGLU fused into the first), combine. Work scales with ``T * k``: for prefill.
- ``MaskedExecutor``: ep_scatter into ``[E, T, H]``, two masked grouped GEMMs, combine.
  No padding to a tile per expert beyond the first, and a fixed grid: for decode.
- ``HybridExecutor``: masked up to a token count, contiguous (or ``grouped_mm``, where the
  benchmark found it faster for large batches) above it. Both choices are data measured by
  bench/moe_bench.py (libs/model/moe/hybrid_thresholds.json).
- ``GroupedMMExecutor``: ``torch._grouped_mm`` on the contiguous layout (CUTLASS on SM90).

**FP8 experts.** ``w13``/``w2`` may be ``Fp8Experts`` (libs/model/fp8.py: e4m3 with
128x128 block scales per expert) instead of tensors. The grouped executors then quantize
each GEMM's activations per token and group of 128 (``ops.per_token_group_quant``, after
the scatter; the masked layout's inside the GEMM) and run the FP8 grouped
GEMMs (``gemm_contiguous`` / ``gemm_masked`` pick by the weights' type); the output is in
the activations' dtype. ``loop`` and ``grouped_mm`` run dense weights only (``runs_fp8``).

The kernels come from ``kernels/moe`` through an ops namespace (``moe_ops_for``): Triton on
CUDA, the torch references on the CPU, so every executor runs everywhere and tests can run
the Triton kernels in the interpreter. An empty batch returns ``[0, H]`` without launching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kernels.moe.select import reference_moe_ops
from kernels.select import ops_for
from libs.model.graph_capture import capturing_graph
from libs.model.moe.routing import Routing


class ExpertExecutor(ABC):
    """One way of running the experts. ``graph_safe``: can be captured in a CUDA graph."""

    name: str = ""
    graph_safe: bool = True
    runs_fp8: bool = True  # takes Fp8Experts as well as dense weights

    def __call__(self, x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        if not self.runs_fp8 and not isinstance(w13, torch.Tensor):
            raise TypeError(f"the {self.name!r} expert executor runs dense weights only; FP8 experts run on the contiguous, masked or hybrid executors")
        if x.shape[0] == 0:
            return x.new_zeros((0, x.shape[1]))
        return self.run(x, routing, w13, w2)

    @abstractmethod
    def run(self, x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for a non-empty batch."""

    def for_tokens(self, num_tokens: int, capturing: bool = False) -> "ExpertExecutor":
        """The executor that actually runs a batch of this size (the hybrid delegates);
        ``capturing``: inside a CUDA graph capture (the hybrid then keeps to its capturable
        tiers)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def gemm_contiguous(ops: SimpleNamespace, a: torch.Tensor, w, m_indices: torch.Tensor, block_m: int, fuse_silu_and_mul: bool = False) -> torch.Tensor:
    """The contiguous grouped GEMM for dense ``w [E, N, K]`` or ``Fp8Experts``."""
    if isinstance(w, torch.Tensor):
        return ops.grouped_gemm_contiguous(a, w, m_indices, block_m, fuse_silu_and_mul=fuse_silu_and_mul)
    a_q, a_s = ops.per_token_group_quant(a)
    return ops.grouped_gemm_contiguous_fp8(
        a_q, a_s, w.q, w.scale, m_indices, block_m, n=_width(w, fuse_silu_and_mul), fuse_silu_and_mul=fuse_silu_and_mul, out_dtype=a.dtype
    )


def gemm_masked(ops: SimpleNamespace, a: torch.Tensor, w, counts: torch.Tensor, block_m: int, fuse_silu_and_mul: bool = False) -> torch.Tensor:
    """The masked grouped GEMM for dense ``w [E, N, K]`` or ``Fp8Experts``."""
    if isinstance(w, torch.Tensor):
        return ops.grouped_gemm_masked(a, w, counts, fuse_silu_and_mul=fuse_silu_and_mul, block_m=block_m)
    # The GEMM quantizes the rows it reads (a_s=None): the masked buffer's [E, max_m, K] is
    # mostly rows past the counts, which a separate quantization pass would read whole.
    return ops.grouped_gemm_masked_fp8(
        a, None, w.q, w.scale, counts, n=_width(w, fuse_silu_and_mul), fuse_silu_and_mul=fuse_silu_and_mul, out_dtype=a.dtype, block_m=block_m,
    )


def _width(w, fuse_silu_and_mul: bool) -> int:
    return w.shape[1] // 2 if fuse_silu_and_mul else w.shape[1]


class LoopExecutor(ExpertExecutor):
    name = "loop"
    graph_safe = False
    runs_fp8 = False

    def run(self, x, routing, w13, w2):
        num_tokens, top_k = routing.ids.shape
        flat = routing.ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < w13.shape[0])
        silu_and_mul = ops_for(x.device).silu_and_mul
        rows = x.new_zeros((num_tokens * top_k, x.shape[1]))
        for e in torch.unique(flat[valid]).tolist():
            pairs = torch.nonzero(flat == e).squeeze(1)
            rows[pairs] = F.linear(silu_and_mul(F.linear(x[torch.div(pairs, top_k, rounding_mode="floor")], w13[e])), w2[e])
        dst = torch.where(valid, torch.arange(flat.numel(), device=x.device), -1).view(num_tokens, top_k)
        return reference_moe_ops().combine(rows, dst, routing.weights)


def contiguous_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """M tile of the contiguous path: 128 when experts average a full tile of rows, else 64
    (each expert's segment pads to a tile, so small batches want small tiles)."""
    return 128 if num_tokens * top_k >= 128 * num_experts else 64


class ContiguousExecutor(ExpertExecutor):
    name = "contiguous"

    def __init__(self, ops: SimpleNamespace, block_m: int | None = None):
        self.ops, self.block_m = ops, block_m

    def run(self, x, routing, w13, w2):
        num_experts = w13.shape[0]
        block_m = self.block_m or contiguous_block_m(x.shape[0], routing.ids.shape[1], num_experts)
        layout = self.ops.scatter_contiguous(x, routing.ids, num_experts, block_m)
        act = gemm_contiguous(self.ops, layout.x, w13, layout.m_indices, block_m, fuse_silu_and_mul=True)
        y = gemm_contiguous(self.ops, act, w2, layout.m_indices, block_m)
        return self.ops.combine(y, layout.dst, routing.weights)


class MaskedExecutor(ExpertExecutor):
    name = "masked"

    def __init__(self, ops: SimpleNamespace):
        self.ops = ops

    def run(self, x, routing, w13, w2):
        num_experts = w13.shape[0]
        layout = self.ops.scatter_masked(x, routing.ids, num_experts)
        # M tile: the rows an expert gets on average (busier experts take more tiles).
        block_m = -(-x.shape[0] * routing.ids.shape[1] // num_experts)
        act = gemm_masked(self.ops, layout.x, w13, layout.counts, block_m, fuse_silu_and_mul=True)
        y = gemm_masked(self.ops, act, w2, layout.counts, block_m)
        return self.ops.combine(y.view(-1, y.shape[2]), layout.dst, routing.weights)


class HybridExecutor(ExpertExecutor):
    """``small`` (masked) for ``num_tokens <= max_masked_tokens``, ``large`` (contiguous)
    above; with a ``largest`` tier (``torch._grouped_mm`` where it was measured faster), that
    one from ``min_largest_tokens`` up. ``largest`` need not be capturable: inside a CUDA
    graph capture its batches run on ``large`` (``for_tokens(n, capturing=True)``), so the
    hybrid is capturable wherever ``small`` and ``large`` are."""

    name = "hybrid"

    def __init__(
        self, small: ExpertExecutor, large: ExpertExecutor, max_masked_tokens: int,
        largest: ExpertExecutor | None = None, min_largest_tokens: int | None = None,
    ):
        if (largest is None) != (min_largest_tokens is None):
            raise ValueError("largest and min_largest_tokens go together")
        if min_largest_tokens is not None and min_largest_tokens <= max_masked_tokens:
            raise ValueError(f"min_largest_tokens ({min_largest_tokens}) must exceed max_masked_tokens ({max_masked_tokens})")
        self.small, self.large, self.max_masked_tokens = small, large, max_masked_tokens
        self.largest, self.min_largest_tokens = largest, min_largest_tokens
        self.graph_safe = small.graph_safe and large.graph_safe
        self.runs_fp8 = all(e.runs_fp8 for e in (small, large, largest) if e is not None)

    def pick(self, num_tokens: int) -> ExpertExecutor:
        if num_tokens <= self.max_masked_tokens:
            return self.small
        if self.largest is not None and num_tokens >= self.min_largest_tokens:
            return self.largest
        return self.large

    def for_tokens(self, num_tokens: int, capturing: bool = False) -> ExpertExecutor:
        chosen = self.pick(num_tokens)
        return self.large if capturing and not chosen.graph_safe and chosen is self.largest else chosen

    def run(self, x, routing, w13, w2):
        return self.for_tokens(x.shape[0], capturing_graph(x.device)).run(x, routing, w13, w2)


class GroupedMMExecutor(ExpertExecutor):
    """``torch._grouped_mm`` (2-D rows x 3-D weights, group ends in ``offs``) on the
    contiguous layout, with 16-row segments (its alignment). Not yet verified under CUDA
    graph capture, so not offered there."""

    name = "grouped_mm"
    graph_safe = False
    runs_fp8 = False
    BLOCK_M = 16

    def __init__(self, ops: SimpleNamespace):
        self.ops = ops

    def run(self, x, routing, w13, w2):
        layout = self.ops.scatter_contiguous(x, routing.ids, w13.shape[0], self.BLOCK_M)
        h = torch._grouped_mm(layout.x, w13.transpose(1, 2), offs=layout.seg_ends)
        y = torch._grouped_mm(ops_for(x.device).silu_and_mul(h), w2.transpose(1, 2), offs=layout.seg_ends)
        return self.ops.combine(y, layout.dst, routing.weights)
