"""FP8 weights in the model (``EngineConfig.quantization = "fp8"``): the weight, the linear
layer that runs it, and quantization at load.

A projection's weight is kept as e4m3 with one fp32 scale per 128 x 128 block, padded to
multiples of 128 (the format and why padding: kernels/fp8/layout.py). ``Fp8Linear`` runs
it two ways, with the same weights:

- FP8 tensor cores (CUDA, SM 8.9+, ``kernels.fp8.fp8_gemm_supported``): the activations
  are quantized per token and group of 128 (by one Triton kernel that also pads them to
  the GEMM's token tile, or inside the GEMM itself), then the block-scaled Triton GEMM
  (swap-AB for few tokens) writes the output in the model's dtype. Only the e4m3 bytes
  stay in device memory.
- Everywhere else, the CPU included: the torch references. The activations are quantized
  and dequantized exactly as on the GPU, and multiplied by the dequantized weight, which
  is computed once and cached in the compute dtype (the "dequantize-then-matmul" path).
  So CPU runs see FP8's error where the GPU does, and CPU tests exercise the format.

Which projections: q/k/v and o of every decoder layer, gate/up and down of every dense
MLP, MoE shared experts included (vLLM's default for FP8 checkpoints), and the MoE
experts. The embeddings, the LM head and MoE routers stay in the model's dtype (a router
is small and its logits pick the experts: vLLM keeps it unquantized too).

MoE experts (``Fp8Experts``): a layer's experts stacked, ``w13 [E, 2I, H]`` and
``w2 [E, H, I]`` in the same format per expert: e4m3 ``[E, N_pad, K_pad]`` and fp32
``[E, N_pad/128, K_pad/128]`` block scales, built from the dense ``Fp8Weight`` of each
expert (quantized at load with ``Fp8Weight.quantize``, or an FP8 checkpoint's
``Fp8Weight.from_checkpoint``), so both paths give the same bytes. The fused gate/up
weight keeps gate and up as two halves, each padded to 128 on its own (a checkpoint's
block grids, unchanged): the up rows start at ``N_pad / 2``, on a block edge. They run
through the grouped FP8 GEMMs of kernels/moe/gemm (Triton on FP8 tensor cores, the
dequantize-then-matmul reference elsewhere) chosen by libs/model/moe/strategy.py; under
expert parallelism each rank stacks only its own experts. Unlike ``Fp8Linear``, the
reference path does not cache dense experts (that would hold the layer twice): it
dequantizes each busy expert at each call, which is fine for tests and tiny models and
slow for real MoE models on the CPU.

Fused projections (q/k/v, gate/up) concatenate their parts along N. Quantized at load,
the fused matrix is quantized as one. From a checkpoint, each part arrives with its own
block grid: parts whose N is a multiple of 128 (every real FP8 checkpoint's) concatenate
as they are; otherwise each part keeps its padding and ``out_index`` picks the real output
columns after the GEMM (an extra gather only for such unusual shapes).

At decode sizes the model calls its FP8 layers through libs/model/linear.py, which sends
them, up to the M measured per shape (kernels/gemv/threshold.json), to the skinny GEMM of
kernels/gemv with their e4m3 weight: the norm before qkv and gate/up, or the activation
before down, folded in, one launch per projection (bf16 layers get the same).
Otherwise, on FP8 tensor cores a layer is one call of ``kernels.fp8.triton_gemm.fp8_linear`` with
the plan ``plan_gemm`` picks for its token count, padded weight shape and GPU (tuned
tiles where ``bench/fp8_tune.py`` measured them): for decode-sized batches the plan
fuses the activation quantization into the GEMM, one launch per layer like a bf16
matmul, instead of a quantization kernel and a GEMM. From ``cublas_min_m()`` tokens up
(prefill sizes; data in kernels/fp8/cublas_threshold.json) a layer runs cuBLASLt's
block-scaled FP8 GEMM instead (``kernels.fp8.cublas_gemm``) where it runs (SM90 with a
torch that has it): the same format and numbers, at Hopper's FP8 speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import BLOCK, FP8_DTYPE, fp8_gemm_supported, plan_gemm
from kernels.fp8.plan import cublas_min_m
from kernels.fp8 import reference as fp8_ref
from kernels.fp8.layout import check_expert_weight, check_weight, padded

# The decoder's projections, by the attribute name they have in libs/model/llama.py.
FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class Fp8Weight:
    """A ``[N, K]`` weight (``shape``) as padded e4m3 ``q [N_pad, K_pad]`` and fp32 block
    scales ``scale [N_pad/128, K_pad/128]``. ``out_index``: for a fusion of parts with
    unaligned rows, the rows of ``q`` holding the N real outputs; None: the first N."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]
    out_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_weight(self.q, self.scale)
        n, k = self.shape
        if padded(k) != self.q.shape[1] or (self.out_index is None and padded(n) != self.q.shape[0]):
            raise ValueError(f"padded weight {tuple(self.q.shape)} does not hold a [{n}, {k}] weight")

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Fp8Weight":
        """Quantize a float ``[N, K]`` weight (on its device, from fp32)."""
        q, scale = fp8_ref.quantize_weight(w.float())
        return cls(q, scale, (w.shape[0], w.shape[1]))

    @classmethod
    def from_checkpoint(cls, q: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> "Fp8Weight":
        """From a checkpoint's unpadded e4m3 ``[N, K]`` and its ``[ceil(N/128), ceil(K/128)]``
        scales (``weight_scale_inv``: despite the name, the factor that dequantizes)."""
        if q.dtype != FP8_DTYPE or q.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        grid = (padded(n) // BLOCK, padded(k) // BLOCK)
        if tuple(scale.shape) != grid:
            raise ValueError(f"{name}: scale shape {tuple(scale.shape)} is not the 128x128 block grid {grid} of a {[n, k]} weight")
        if not scale.is_floating_point() or not torch.isfinite(scale.float()).all():
            raise ValueError(f"{name}: block scales must be finite floats, got {scale.dtype}")
        full = torch.zeros(padded(n), padded(k), dtype=FP8_DTYPE, device=q.device)
        full[:n, :k] = q
        return cls(full, scale.float().contiguous(), (n, k))

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight."""
        dense = fp8_ref.dequantize_weight(self.q, self.scale)
        rows = dense[: self.shape[0]] if self.out_index is None else dense[self.out_index]
        return rows[:, : self.shape[1]]

    def narrow(self, dim: int, start: int, stop: int, name: str = "weight") -> "Fp8Weight":
        """Rows (``dim`` 0) or columns (1) ``[start, stop)`` along whole 128-blocks, with
        their own scales: a tensor-parallel shard of the very weight TP=1 runs. A cut
        inside a block would need new scales (other weights, other KV), so it is refused."""
        full = self.shape[dim]
        if self.out_index is not None or start % BLOCK or (stop % BLOCK and stop != full) or not 0 <= start < stop <= full:
            raise ValueError(
                f"{name}: an FP8 weight splits for tensor parallelism only along its {BLOCK}-blocks, "
                f"not at [{start}, {stop}) of {full} (use a tensor_parallel_size that cuts heads and the MLP at multiples of {BLOCK})"
            )
        q_stop = self.q.shape[dim] if stop == full else stop
        q = self.q.narrow(dim, start, q_stop - start).contiguous()
        scale = self.scale.narrow(dim, start // BLOCK, -(-q_stop // BLOCK) - start // BLOCK).contiguous()
        shape = (stop - start, self.shape[1]) if dim == 0 else (self.shape[0], stop - start)
        return Fp8Weight(q, scale, shape)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Fuse parts along N (q/k/v, gate/up); each keeps its own blocks."""
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"cannot fuse FP8 weights of different K: {[p.shape for p in parts]}")
        n = sum(p.shape[0] for p in parts)
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts])
        if all(p.out_index is None and p.shape[0] % BLOCK == 0 for p in parts[:-1]) and parts[-1].out_index is None:
            return Fp8Weight(q, scale, (n, k))  # the padding (if any) is at the very end
        index, offset = [], 0
        for p in parts:
            own = torch.arange(p.shape[0], device=p.q.device) if p.out_index is None else p.out_index
            index.append(own + offset)
            offset += p.q.shape[0]
        return Fp8Weight(q, scale, (n, k), torch.cat(index))


@functools.lru_cache(maxsize=None)
def runs_fp8_kernels(device: torch.device) -> bool:
    """Whether FP8 layers on ``device`` run the GPU kernels (else the references)."""
    return fp8_gemm_supported(device)


class _Fp8Module(nn.Module):
    """A module whose ``_FP8_BUFFERS`` (e4m3 values, fp32 scales, index) are moved with the
    model, never cast: ``model.to(dtype=bf16)`` must not turn the e4m3 bytes into bf16 nor
    round the fp32 scales (other parameters and buffers are cast as usual)."""

    _FP8_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        ours = {k: self._buffers.pop(k) for k in self._FP8_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0, device=ours[self._FP8_BUFFERS[0]].device)).device
            for k, v in ours.items():
                self._buffers[k] = None if v is None else v.to(device)
            self._moved()
        return self

    def _moved(self) -> None:
        """After a move: drop what was derived from the buffers on the old device."""


class Fp8Linear(_Fp8Module):
    """``y = x @ w.T (+ bias)`` with ``w`` an ``Fp8Weight`` and the activations quantized
    per token and group of 128: Triton kernels on FP8 tensor cores, the torch references
    (dequantize, then matmul) everywhere else."""

    _FP8_BUFFERS = ("weight_q", "weight_scale", "out_index")

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_q", weight.q)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("out_index", weight.out_index)
        self.register_buffer("bias", bias)
        self._dense: torch.Tensor | None = None  # the dequantized weight, off FP8 tensor cores

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight_q, self.weight_scale, (self.out_features, self.in_features), self.out_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, m = x.shape[:-1], x[..., 0].numel()
        x2 = x.reshape(m, self.in_features)
        n = self.out_features if self.out_index is None else self.weight_q.shape[0]
        if m == 0:
            y = x2.new_empty((0, n))
        elif runs_fp8_kernels(x.device):
            y = self._fp8_gemm(x2, n)
        else:
            q, s = fp8_ref.per_token_group_quant(x2)
            x_dq = fp8_ref.dequantize_activation(q, s)[:m, : self.in_features]
            y = F.linear(x_dq.to(x.dtype), self._dequantized(x.dtype))
        if self.out_index is not None:
            y = y.index_select(1, self.out_index)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _fp8_gemm(self, x: torch.Tensor, n: int) -> torch.Tensor:
        from kernels.fp8 import cublas_gemm, triton_gemm

        n_pad, k_pad = self.weight_q.shape
        if x.shape[0] >= cublas_min_m() and cublas_gemm.cublas_block_fp8_usable(x.device, n_pad, k_pad):
            return cublas_gemm.fp8_linear(x, self.weight_q, self.weight_scale, n=n, out_dtype=x.dtype)
        plan = plan_gemm(x.shape[0], n=n_pad, k=k_pad, device=x.device)
        return triton_gemm.fp8_linear(x, self.weight_q, self.weight_scale, n=n, out_dtype=x.dtype, plan=plan)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``[n, K]`` in ``dtype``, computed once (the weights never change)."""
        if self._dense is None or self._dense.dtype != dtype:
            dense = fp8_ref.dequantize_weight(self.weight_q, self.weight_scale)[:, : self.in_features]
            if self.out_index is None:
                dense = dense[: self.out_features]
            self._dense = dense.to(dtype).contiguous()
        return self._dense

    def _moved(self) -> None:
        self._dense = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


class Fp8Experts(_Fp8Module):
    """A MoE layer's stacked expert weights ``[E, N, K]`` (``shape``, like the dense tensor
    it replaces) as e4m3 ``q [E, N_pad, K_pad]`` with fp32 block scales ``scale
    [E, N_pad/128, K_pad/128]``. Each expert's rows are ``parts`` equal parts (gate and up
    for ``w13``; one for ``w2``), each padded to 128 rows on its own. The grouped GEMMs
    read ``q`` and ``scale`` (libs/model/moe/executors.py); ``dequantize`` gives the
    dense weights back (tests, and loading without fp8)."""

    _FP8_BUFFERS = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int, int], parts: int = 1):
        super().__init__()
        check_expert_weight(q, scale)
        e, n, k = shape
        if q.shape[0] != e or n % parts or q.shape[1] != parts * padded(n // parts) or q.shape[2] != padded(k):
            raise ValueError(f"padded expert weights {tuple(q.shape)} do not hold {parts} part(s) of a {list(shape)} weight")
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.shape, self.parts = (e, n, k), parts

    @classmethod
    def stack(cls, experts: list[list[Fp8Weight]]) -> "Fp8Experts":
        """From each expert's parts (``[gate, up]`` or ``[down]``), all of one shape."""
        first = experts[0][0]
        if any(len(parts) != len(experts[0]) or any(p.shape != first.shape or p.out_index is not None for p in parts) for parts in experts):
            raise ValueError(f"experts must have the same parts of one shape {first.shape}")
        q = torch.stack([torch.cat([p.q for p in parts]) for parts in experts])
        scale = torch.stack([torch.cat([p.scale for p in parts]) for parts in experts])
        parts = len(experts[0])
        return cls(q, scale, (len(experts), parts * first.shape[0], first.shape[1]), parts)

    @classmethod
    def quantize(cls, w: torch.Tensor, parts: int = 1, device: torch.device | None = None) -> "Fp8Experts":
        """Quantize float ``[E, N, K]`` expert by expert (on ``device``, from fp32): peak
        memory is one expert's fp32 copy, not the layer's."""
        device = device or w.device
        return cls.stack([[Fp8Weight.quantize(p) for p in w[e].to(device=device, dtype=torch.float32).chunk(parts)] for e in range(w.shape[0])])

    def narrow_experts(self, first: int, count: int) -> "Fp8Experts":
        """Experts ``[first, first + count)``: an expert-parallel rank's share, same bytes."""
        q = self.q[first:first + count].contiguous()
        return Fp8Experts(q, self.scale[first:first + count].contiguous(), (count, *self.shape[1:]), self.parts)

    def part(self, e: int, i: int) -> Fp8Weight:
        """Expert ``e``'s part ``i`` as a dense-layer ``Fp8Weight`` (views, no copy)."""
        rows = self.q.shape[1] // self.parts
        n = self.shape[1] // self.parts
        return Fp8Weight(self.q[e, i * rows:(i + 1) * rows], self.scale[e, i * rows // BLOCK:(i + 1) * rows // BLOCK], (n, self.shape[2]))

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[E, N, K]`` weights."""
        return torch.stack([torch.cat([self.part(e, i).dequantize() for i in range(self.parts)]) for e in range(self.shape[0])])

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, parts={self.parts}, fp8 e4m3 128x128 blocks per expert"


@torch.no_grad()
def quantize_projections(model: nn.Module, device: torch.device) -> int:
    """Replace each decoder layer's dense projections (``FP8_PROJECTIONS`` of its attention,
    of its dense MLP, and of a MoE block's shared expert) with an ``Fp8Linear`` quantized
    from its fp32 weight on ``device`` (fast on a GPU, and the model is moved there next
    anyway), and a MoE block's experts with ``Fp8Experts`` (``quantize_experts``).
    Projections that are already FP8 (a checkpoint's) are left alone. Returns how many
    projections (an expert stack counts one) were quantized."""
    count = 0
    for layer in model.layers:
        mlp = layer.mlp
        for parent in (layer.self_attn, mlp, getattr(mlp, "shared_expert", None)):
            for attr in FP8_PROJECTIONS if parent is not None else ():
                module = getattr(parent, attr, None)
                if type(module) is nn.Linear:
                    bias = None if module.bias is None else module.bias.detach().clone()
                    weight = Fp8Weight.quantize(module.weight.detach().to(device=device, dtype=torch.float32))
                    setattr(parent, attr, Fp8Linear(weight, bias))
                    count += 1
        if hasattr(mlp, "quantize_experts"):
            count += mlp.quantize_experts(device)
    return count
